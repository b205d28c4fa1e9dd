"""How far the cost model's step time for each speculation level has been off, measured.

The draft's price per pass is told apart from its fixed price per call only by steps at
several levels, and a policy that runs one level most of the time sees few others: traced
in the bench, one step at k = 3 left the draft's fit at 0.02 ms per call and 2.7 ms per
pass (the truth was about 1.5 and 1.8) for a hundred samples, and the shallow levels
looked cheap. Each level's own measured time against the model's figure corrects that.

Tokens are not compared here. A per-level ratio of emitted to expected tokens learns the
bench's one batch-1 prompt, where the positions the draft gets wrong fall where k = 4
puts the target's free token (k = 4 emits 4.0 tokens per step, k = 3 3.0), but across
prompts it credits a level with the sequences it ran on: shrunk rates undervalue the best
sequences, and replayed over 32 prompts a prompt whose draft was always right ran level
2 for its whole request (0.70x of static k = 4) on a level-2 factor of 1.31 earned by
such sequences. What a sequence emits is its acceptance estimate's business.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from scheduler.outcome_sums import OutcomeSums
from scheduler.step_cost import batch_bucket


@dataclass
class LevelCorrection:
    """Per batch-size bucket and level ``m`` (the step's longest proposal), discounted
    sums of how long decode steps at that level took and how long the model predicted. A
    level's ratio (predicted over measured), divided by the bucket's ratio over all
    levels, scales the model's figure for that level: only how levels compare is
    corrected here (on against off is ``GoodputSwitch``'s).

    Sums decay per observation of their own level, so a level that runs only in level
    trials (now and then, less often while it keeps losing) keeps its last few
    measurements. A level with fewer than ``min_samples`` keeps the model's figure, and
    factors stay within ``limits``: a few noisy steps must not bury a level for long.
    Each level's ratio is also shrunk towards the typical one by ``prior_steps``
    pseudo-steps: the machine's speed drifts (the same draft call took 8-16 ms within one
    bench run), and a level measured twice in a fast spell must not take over."""

    decay: float = 0.8               # about a level's last five steps
    min_samples: int = 2
    prior_steps: float = 2.0         # each level's ratio gets these at the typical one
    limits: tuple[float, float] = (0.67, 1.5)
    observations: int = 0
    _sums: OutcomeSums = field(init=False)      # per (bucket, level)

    def __post_init__(self) -> None:
        self._sums = OutcomeSums(self.decay)

    def observe(self, num_seqs: int, level: int, seconds: float, predicted_seconds: float) -> None:
        if level <= 0 or min(seconds, predicted_seconds) <= 0:
            return
        self._sums.add((batch_bucket(num_seqs), level), seconds, predicted_seconds)
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
