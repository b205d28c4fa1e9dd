"""How often the target accepts a proposal, by the draft's own probability of it.

A draft model is not calibrated against its target: read as probabilities, the draft's
figures would stop good proposals early (figures in docs/adaptive-policy.md). The
calibration is measured online, from every proposal the target looked at, and travels to
the draft worker as ``StepPlan.reach_map``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specray.scheduler.messages import REACH_BINS, decile


@dataclass
class ConfidenceCalibration:
    """Per decile of the draft's probability, discounted counts of the proposals the target
    looked at (each one up to and including the first rejected) and of those it accepted.
    A decile's figure is its acceptance rate shrunk towards its midpoint, what a calibrated
    draft would get, by ``prior_weight`` pseudo-observations."""

    decay: float = 0.995             # about a decile's last two hundred proposals
    prior_weight: float = 2.0
    observations: int = 0
    _looked: list[float] = field(default_factory=lambda: [0.0] * REACH_BINS)
    _accepted: list[float] = field(default_factory=lambda: [0.0] * REACH_BINS)

    def __post_init__(self) -> None:
        if not 0.0 < self.decay <= 1.0:
            raise ValueError(f"calibration decay must be in (0, 1], got {self.decay}")

    def observe(self, confidence: list[float], accepted: int) -> None:
        """One sequence-step: the draft's probability of each proposal, and how many of
        them the target accepted. Proposals after the first rejection were never judged."""
        for j, c in enumerate(confidence[:accepted + 1]):
            b = decile(c)
            self._looked[b] = self._looked[b] * self.decay + 1.0
            self._accepted[b] = self._accepted[b] * self.decay + (1.0 if j < accepted else 0.0)
        self.observations += 1

    def reach_map(self) -> list[float]:
        w = self.prior_weight
        return [(a + w * (b + 0.5) / REACH_BINS) / (n + w)
                for b, (a, n) in enumerate(zip(self._accepted, self._looked))]

