"""How likely a sequence's draft is to be right: per-sequence acceptance estimates, how
much they should be trusted over the draft's rate across sequences, and a calibration of
what they predict for deeper proposals against what was accepted."""

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
    reached: list[float] = field(default_factory=list)
    hits: list[float] = field(default_factory=list)
    last_full: bool = False          # its last proposal was accepted whole
    assumed_rate: float | None = None    # the rate the policy's last choice for it assumed

    def rate(self, prior: float, prior_weight: float = 1.0) -> float:
        """Accepted per proposal reached, with ``prior_weight`` pseudo-proposals at ``prior``."""
        return (self.accepted + prior * prior_weight) / (self.accepted + self.rejected + prior_weight)

    def observe(self, proposed: int, accepted: int, decay: float) -> None:
        if proposed == 0:
            return
        self.last_full = accepted >= proposed
        self.accepted = self.accepted * decay + accepted
        self.rejected = self.rejected * decay + (1 if accepted < proposed else 0)
        for j in range(len(self.reached), min(proposed, accepted + 1)):
            self.reached.append(0.0)
            self.hits.append(0.0)
        for j in range(min(proposed, accepted + 1)):
            self.reached[j] = self.reached[j] * decay + 1.0
            self.hits[j] = self.hits[j] * decay + (1.0 if j < accepted else 0.0)


@dataclass
class RateSpread:
    """How far sequences' acceptance rates really differ, so that each one's own record
    is trusted as much as it deserves (empirical Bayes).

    Each sequence's rate is taken as drawn from a beta distribution around the draft's
    overall rate; the posterior mean is the sequence's counts plus ``weight``
    pseudo-proposals at the overall rate, where ``weight = 1 / rho - 1`` and ``rho`` is the
    intra-sequence correlation: near 0 when sequences are alike (their own noise is then
    mostly luck, so lean on the overall rate), near 1 when they differ a lot. Why: one
    step's accepted count says little about the next, so a sequence's last few steps alone
    chase noise (measurements in docs/adaptive-policy.md).

    ``rho`` comes from the batch's cross-section by the method of moments for the
    beta-binomial with unequal counts (``n_i`` proposals reached, ``A_i`` accepted, ``p``
    the batch's pooled rate, ``S = sum n_i (A_i / n_i - p)^2``)::

        E[S] = p (1 - p) [(m - 1) + rho (N - sum n_i^2 / N - (m - 1))]

    summed over steps with a discount (each step's batch is one more look at the same
    population; at batch 1 there is no cross-section and the history speaks)."""

    decay: float = 0.99
    # Before any cross-section: as if sequences were moderately alike (weight 15).
    prior_weight: float = 15.0
    observations: int = 0            # cross-sections counted so far
    _num: float = 0.0
    _den: float = 0.0

    def observe(self, estimates: list[AcceptanceEstimate]) -> None:
        counts = [(e.accepted, e.accepted + e.rejected) for e in estimates if e.accepted + e.rejected > 0]
        m = len(counts)
        if m < 2:
            return
        total = sum(n for _, n in counts)
        p = sum(a for a, _ in counts) / total
        if not 0.0 < p < 1.0:
            return              # every proposal accepted, or none: no spread to measure
        s = sum(n * (a / n - p) ** 2 for a, n in counts)
        den = total - sum(n * n for _, n in counts) / total - (m - 1)
        if den <= 0:
            return
        self._num = self._num * self.decay + s / (p * (1.0 - p)) - (m - 1)
        self._den = self._den * self.decay + den
        self.observations += 1

    def rates(self, estimates: list[AcceptanceEstimate], overall: float) -> list[float]:
        """The posterior mean of each sequence's acceptance rate given its counts, under
        the beta prior centred on the draft's ``overall`` rate."""
        w = max(self.weight, 0.5)
        mean = min(max(overall, 1e-3), 1.0 - 1e-3)
        return [(e.accepted + mean * w) / (e.accepted + e.rejected + w) for e in estimates]

    @property
    def weight(self) -> float:
        """Pseudo-proposals of the overall rate to add to each sequence's own counts."""
        prior_den = 4.0 * (self.prior_weight + 1.0)     # worth a few sequences' counts
        rho = (self._num + 4.0) / (self._den + prior_den)
        return 1.0 / min(1.0, max(rho, 0.01)) - 1.0


@dataclass
class DepthCalibration:
    """How far a sequence's acceptance rate ``a_i`` misjudges its deeper proposals.

    ``a_i^j`` assumes each proposal is accepted independently; in practice acceptance
    given the previous one was accepted climbs with depth (easy stretches of text are easy
    for several tokens), so ``a^j`` would undervalue deep proposals and the policy would
    trim proposals that pay (figures in docs/adaptive-policy.md). Two corrections, both
    from the runtime's own outcomes:

    - across sequences, per depth j, discounted sums of what the rate predicted for a
      reached j-th proposal (``a_i``) and what was accepted: their ratio ``lift_j``
      scales ``a_i`` at that depth. Kept apart for sequences whose previous proposal was
      accepted whole and the others: a rate that leans on recent steps over-reacts to the
      last one; the calibration measures whatever is left;
    - per sequence, its own counts at depth j pull the calibrated ``a_i * lift_j``
      towards what that sequence did there (``sequence_weight`` pseudo-observations of
      the calibrated rate; the policy passes ``RateSpread.weight``, the same trust it
      gives the sequence's overall record).

    The j-th proposal then gains the product of the first j conditional rates."""

    decay: float = 0.999             # about the last thousand proposals at each depth
    prior_weight: float = 4.0        # pseudo-observations of "the rate is right", across sequences
    sequence_weight: float = 2.0     # pseudo-observations of the calibrated rate, per sequence
    # Per state of the sequence's previous proposal (accepted whole or not), per depth.
    predicted: dict[bool, list[float]] = field(default_factory=lambda: {False: [], True: []})
    realised: dict[bool, list[float]] = field(default_factory=lambda: {False: [], True: []})
    observations: int = 0

    def observe(self, rate: float, proposed: int, accepted: int, after_full: bool = False) -> None:
        self.observations += 1
        predicted, realised = self.predicted[after_full], self.realised[after_full]
        reached = min(proposed, accepted + 1)
        for j in range(len(predicted), reached):
            predicted.append(0.0)
            realised.append(0.0)
        for j in range(reached):
            predicted[j] = predicted[j] * self.decay + rate
            realised[j] = realised[j] * self.decay + (1.0 if j < accepted else 0.0)

    def lift(self, j: int, after_full: bool = False) -> float:
        """Accepted over predicted at depth ``j`` (1-based) for sequences whose previous
        proposal was (``after_full``) or was not accepted whole; 1 while nothing is known;
        past the deepest depth seen, the deepest one's."""
        predicted, realised = self.predicted[after_full], self.realised[after_full]
        if j > len(predicted):
            return self.lift(len(predicted), after_full) if predicted else 1.0
        w = self.prior_weight
        return min(4.0, max(0.25, (realised[j - 1] + w) / (predicted[j - 1] + w)))

    def gains(self, rates: list[float], caps: list[int], estimates: list[AcceptanceEstimate] | None = None,
              sequence_weight: float | None = None) -> list[list[float]]:
        """Per sequence, the expected tokens gained by its 1st..cap-th proposal: products
        of conditional acceptance probabilities, so at most 1 and never rising with depth."""
        depths = range(1, max(caps, default=0) + 1)
        lifts: dict[bool, list[float]] = {}       # per state, only for the states present
        w = self.sequence_weight if sequence_weight is None else sequence_weight
        out = []
        for i, (rate, cap) in enumerate(zip(rates, caps)):
            e = estimates[i] if estimates is not None else None
            state = e is not None and e.last_full
            if state not in lifts:
                lifts[state] = [self.lift(j, state) for j in depths]
            row, g = [], 1.0
            for j, lift in enumerate(lifts[state][:cap]):
                c = min(1.0, rate * lift)
                if e is not None and j < len(e.reached):
                    c = (e.hits[j] + w * c) / (e.reached[j] + w)
                g *= c
                row.append(g)
            out.append(row)
        return out
