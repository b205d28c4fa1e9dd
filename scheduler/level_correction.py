"""How far the cost model's figure for each speculation level has been off, measured.

The model values the j-th proposal as if acceptance at each position did not depend on
how long the proposal is. It does: when every proposal is accepted the target adds its
own next token for free, so which positions a draft must guess depends on k. On the
bench's batch-1 prompt the positions the draft gets wrong fall where k = 4 puts that
free token: k = 4 emits 4.0 tokens per step, k = 3 emits 3.0 and k = 2 2.3, while the
model, which sees only per-position rates, rates levels 2-4 within a few percent of each
other. No per-position estimate can learn that; a measurement per level can.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from scheduler.outcome_sums import OutcomeSums
from scheduler.step_cost import batch_bucket


@dataclass
class LevelCorrection:
    """Per batch-size bucket and level ``m`` (the step's longest proposal), discounted
    sums of what decode steps at that level emitted and took, and of what the model
    predicted for them. A level's ratio, measured over predicted goodput, divided by the
    bucket's ratio over all levels, scales the model's figure for that level: only how
    levels compare is corrected here (on against off is ``GoodputSwitch``'s).

    Sums decay per observation of their own level, so a level that runs only in level
    trials (now and then, less often while it keeps losing) keeps its last few measurements. A
    level with fewer than ``min_samples`` keeps the model's figure, and factors stay
    within ``limits``: a few noisy steps must not bury a level for long.

    Levels run in different stretches of text, so a level tried twice where the draft
    happened to do well measures better than one that runs everywhere. Measured with
    batch-1 runs alone: two such trial steps gave level 1 a factor of 1.24, it then ran
    four steps in a row and its full acceptances there raised it further; the policy
    ended at 0.88 of static k, against 0.97 with no correction at all (yet with batch
    sizes rotating, as in the bench, the correction is worth having: 0.97 against 0.90).
    So each level's ratio is shrunk towards the typical one by ``prior_steps``
    pseudo-steps: 0.96 of static k alone, 0.95 rotating."""

    decay: float = 0.8               # about a level's last five steps
    min_samples: int = 2
    prior_steps: float = 2.0         # each level's ratio gets these at the typical one
    limits: tuple[float, float] = (0.67, 1.5)
    observations: int = 0
    _sums: OutcomeSums = field(init=False)      # per (bucket, level)

    def __post_init__(self) -> None:
        self._sums = OutcomeSums(self.decay)

    def observe(self, num_seqs: int, level: int, tokens: int, seconds: float,
                predicted_tokens: float, predicted_seconds: float) -> None:
        if level <= 0 or min(tokens, seconds, predicted_tokens, predicted_seconds) <= 0:
            return
        self._sums.add((batch_bucket(num_seqs), level), tokens, seconds, predicted_tokens, predicted_seconds)
        self.observations += 1

    def factors(self, num_seqs: int, levels: list[int]) -> dict[int, float]:
        """Level -> factor for the model's goodput figure at this batch size (1 for a level
        not yet measured enough)."""
        b = batch_bucket(num_seqs)
        ratios = {m: r for m in levels if (r := self._sums.ratio((b, m), self.min_samples)) is not None}
        if len(ratios) < 2:
            return {m: 1.0 for m in levels}
        # Relative to the measured levels' typical ratio, weighted by how often each ran.
        weight = {m: self._sums.steps((b, m)) for m in ratios}
        mean = sum(ratios[m] * weight[m] for m in ratios) / sum(weight.values())
        lo, hi = self.limits
        out = {}
        for m in levels:
            if m not in ratios:
                out[m] = 1.0
                continue
            # Shrunk by the level's decayed step count (see the class docstring).
            n = weight[m] if self.decay >= 1.0 else (1.0 - self.decay ** weight[m]) / (1.0 - self.decay)
            ratio = (n * ratios[m] + self.prior_steps * mean) / (n + self.prior_steps)
            out[m] = min(hi, max(lo, ratio / mean))
        return out
