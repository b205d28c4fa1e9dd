"""How likely a sequence's draft is to be right: per-sequence acceptance estimates, and
a calibration of what they predict for deeper proposals against what was accepted."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class AcceptanceEstimate:
    """Discounted counts of accepted and rejected proposals of one sequence."""

    accepted: float = 0.0
    rejected: float = 0.0
    steps_without_proposal: int = 0
    quiet_limit: int = 0             # quiet steps before the next probe (0: the policy's base)

    def rate(self, prior: float, prior_weight: float = 1.0) -> float:
        return (self.accepted + prior * prior_weight) / (self.accepted + self.rejected + prior_weight)

    def observe(self, proposed: int, accepted: int, decay: float) -> None:
        if proposed == 0:
            self.steps_without_proposal += 1
            return
        self.steps_without_proposal = 0
        self.accepted = self.accepted * decay + accepted
        self.rejected = self.rejected * decay + (1 if accepted < proposed else 0)


@dataclass
class DepthCalibration:
    """How far a sequence's acceptance rate ``a_i`` misjudges its deeper proposals.

    ``a_i^j`` assumes each proposal is accepted independently. Measured on the built-in
    pair, acceptance given the previous one was accepted climbs with depth (0.69, 0.77,
    0.80, 0.81 for positions 1-4: easy stretches of text are easy for several tokens), so
    ``a^j`` undervalues the 3rd and 4th proposals by a third or more and the policy would
    trim proposals that pay. This keeps, per position j, discounted sums of what was
    predicted (``a_i^j`` at the time) and what was accepted, and scales the gain by their
    ratio: a calibration from the runtime's own outcomes, whatever the cause of the
    error."""

    decay: float = 0.999             # about the last thousand proposals at each position
    prior_weight: float = 4.0        # pseudo-observations of "the model is right"
    predicted: list[float] = field(default_factory=list)
    realised: list[float] = field(default_factory=list)

    def observe(self, rate: float, proposed: int, accepted: int) -> None:
        for j in range(len(self.predicted), proposed):
            self.predicted.append(0.0)
            self.realised.append(0.0)
        p = 1.0
        for j in range(proposed):
            p *= rate
            self.predicted[j] = self.predicted[j] * self.decay + p
            self.realised[j] = self.realised[j] * self.decay + (1.0 if j < accepted else 0.0)

    def lift(self, j: int) -> float:
        """Realised over predicted at position ``j`` (1-based), 1 while nothing is known."""
        if j > len(self.predicted):
            return self.lift(len(self.predicted)) if self.predicted else 1.0
        w = self.prior_weight
        return min(4.0, max(0.25, (self.realised[j - 1] + w) / (self.predicted[j - 1] + w)))

    def gains(self, rates: list[float], caps: list[int]) -> list[list[float]]:
        """Per sequence, the expected tokens gained by its 1st..cap-th proposal: calibrated,
        at most 1, and never rising with depth (a later proposal needs every earlier one)."""
        lifts = [self.lift(j) for j in range(1, max(caps, default=0) + 1)]
        out = []
        for rate, cap in zip(rates, caps):
            row, g, p = [], 1.0, 1.0
            for lift in lifts[:cap]:
                p *= rate
                g = min(g, p * lift)
                row.append(g)
            out.append(row)
        return out
