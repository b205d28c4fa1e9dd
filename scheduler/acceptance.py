"""How likely a sequence's draft is to be right: per-sequence acceptance estimates, and
a calibration of what they predict for deeper proposals against what was accepted."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class AcceptanceEstimate:
    """Discounted counts of one sequence's proposals: accepted and rejected overall (its
    per-token rate ``a_i``), and per depth j, how often the j-th proposal was reached
    (every earlier one accepted) and accepted. Each depth's counts decay on their own
    updates, so a depth the sequence seldom reaches keeps what it has seen."""

    accepted: float = 0.0
    rejected: float = 0.0
    steps_without_proposal: int = 0
    quiet_limit: int = 0             # quiet steps before the next probe (0: the policy's base)
    reached: list[float] = field(default_factory=list)
    hits: list[float] = field(default_factory=list)

    def rate(self, prior: float, prior_weight: float = 1.0) -> float:
        return (self.accepted + prior * prior_weight) / (self.accepted + self.rejected + prior_weight)

    def observe(self, proposed: int, accepted: int, decay: float) -> None:
        if proposed == 0:
            self.steps_without_proposal += 1
            return
        self.steps_without_proposal = 0
        self.accepted = self.accepted * decay + accepted
        self.rejected = self.rejected * decay + (1 if accepted < proposed else 0)
        for j in range(len(self.reached), min(proposed, accepted + 1)):
            self.reached.append(0.0)
            self.hits.append(0.0)
        for j in range(min(proposed, accepted + 1)):
            self.reached[j] = self.reached[j] * decay + 1.0
            self.hits[j] = self.hits[j] * decay + (1.0 if j < accepted else 0.0)


@dataclass
class DepthCalibration:
    """How far a sequence's acceptance rate ``a_i`` misjudges its deeper proposals.

    ``a_i^j`` assumes each proposal is accepted independently. Measured on the built-in
    pair, acceptance given the previous one was accepted climbs with depth (0.69, 0.77,
    0.80, 0.81 for positions 1-4: easy stretches of text are easy for several tokens), so
    ``a^j`` undervalues the 3rd and 4th proposals by a third or more and the policy would
    trim proposals that pay. Two corrections, both from the runtime's own outcomes:

    - across sequences, per depth j, discounted sums of what the rate predicted for a
      reached j-th proposal (``a_i``) and what was accepted: their ratio ``lift_j``
      scales ``a_i`` at that depth;
    - per sequence, its own counts at depth j pull the calibrated ``a_i * lift_j``
      towards what that sequence did there (``sequence_weight`` pseudo-observations of
      the calibrated rate).

    The j-th proposal then gains the product of the first j conditional rates."""

    decay: float = 0.999             # about the last thousand proposals at each depth
    prior_weight: float = 4.0        # pseudo-observations of "the rate is right", across sequences
    sequence_weight: float = 2.0     # pseudo-observations of the calibrated rate, per sequence
    predicted: list[float] = field(default_factory=list)
    realised: list[float] = field(default_factory=list)

    def observe(self, rate: float, proposed: int, accepted: int) -> None:
        reached = min(proposed, accepted + 1)
        for j in range(len(self.predicted), reached):
            self.predicted.append(0.0)
            self.realised.append(0.0)
        for j in range(reached):
            self.predicted[j] = self.predicted[j] * self.decay + rate
            self.realised[j] = self.realised[j] * self.decay + (1.0 if j < accepted else 0.0)

    def lift(self, j: int) -> float:
        """Accepted over predicted at depth ``j`` (1-based), 1 while nothing is known;
        past the deepest depth seen, the deepest one's."""
        if j > len(self.predicted):
            return self.lift(len(self.predicted)) if self.predicted else 1.0
        w = self.prior_weight
        return min(4.0, max(0.25, (self.realised[j - 1] + w) / (self.predicted[j - 1] + w)))

    def gains(self, rates: list[float], caps: list[int],
              estimates: list[AcceptanceEstimate] | None = None) -> list[list[float]]:
        """Per sequence, the expected tokens gained by its 1st..cap-th proposal: products
        of conditional acceptance probabilities, so at most 1 and never rising with depth."""
        lifts = [self.lift(j) for j in range(1, max(caps, default=0) + 1)]
        w = self.sequence_weight
        out = []
        for i, (rate, cap) in enumerate(zip(rates, caps)):
            e = estimates[i] if estimates is not None else None
            row, g = [], 1.0
            for j, lift in enumerate(lifts[:cap]):
                c = min(1.0, rate * lift)
                if e is not None and j < len(e.reached):
                    c = (e.hits[j] + w * c) / (e.reached[j] + w)
                g *= c
                row.append(g)
            out.append(row)
        return out
