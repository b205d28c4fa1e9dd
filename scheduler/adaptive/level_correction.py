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

import math
from dataclasses import dataclass, field

from specray.scheduler.adaptive.outcome_sums import OutcomeSums
from specray.scheduler.adaptive.step_cost import batch_bucket


@dataclass
class LevelCorrection:
    """Per batch-size bucket: which level runs (the one the last two speculating steps
    ran), the discounted sums of its steps' measured and predicted times (their ratio,
    predicted over measured, says how the machine runs just now), and for every other
    level, how its steps compared with that ratio when it was tried: each trial step's
    ratio over the running level's of the moment (in logs, on one scale across changes
    of the running level: a trial against level 3 and one against level 4 add up).

    Paired, because the machine's speed drifts for every level alike (the same draft call
    took 8-16 ms within one bench run) and a level runs only in trials: compared with the
    running level's steps of another minute, a level tried in a slow spell looked 10-15 %
    worse than when compared with the steps around it (traced at batch 8 and 32 in
    process). A level's factor is then its paired figure over the running level's (1 for
    the running level itself, and for a level with fewer than ``min_samples`` trials),
    shrunk towards 1 by ``prior_steps`` pseudo-trials (a level tried twice in a fast
    spell must not take over) and kept within ``limits``. Pairs decay per trial of their
    own level, so a level that runs only now and then keeps its last few."""

    decay: float = 0.8               # about a level's last five trials
    min_samples: int = 2
    prior_steps: float = 2.0         # each level's figure gets these at the running level's
    limits: tuple[float, float] = (0.67, 1.5)
    observations: int = 0
    _sums: OutcomeSums = field(init=False)      # per (bucket, level): recent steps' times
    _running: dict[int, int] = field(default_factory=dict)   # bucket -> the level that runs
    _last: dict[int, int] = field(default_factory=dict)      # bucket -> the last step's level
    # (bucket, level) -> [weight, weighted sum of log efficiency, trials]
    _pairs: dict[tuple[int, int], list[float]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._sums = OutcomeSums(self.decay)

    def observe(self, num_seqs: int, level: int, seconds: float, predicted_seconds: float) -> None:
        if level <= 0 or min(seconds, predicted_seconds) <= 0:
            return
        b = batch_bucket(num_seqs)
        running = self._running.get(b)
        if running is None or self._last.get(b) == level:
            running = self._running[b] = level       # the policy has moved here
        if level != running:
            now = self._sums.ratio((b, running), 1)
            if now is not None:
                pair = self._pairs.setdefault((b, level), [0.0, 0.0, 0])
                base = self._efficiency(b, running)
                pair[0] = pair[0] * self.decay + 1.0
                pair[1] = pair[1] * self.decay + base + math.log(predicted_seconds / seconds / now)
                pair[2] += 1
        self._sums.add((b, level), seconds, predicted_seconds)
        self._last[b] = level
        self.observations += 1

    def _efficiency(self, b: int, level: int) -> float:
        """The level's log efficiency on the bucket's common scale (0: never tried)."""
        pair = self._pairs.get((b, level))
        return pair[1] / pair[0] if pair else 0.0

    def factors(self, num_seqs: int, levels: list[int]) -> dict[int, float]:
        """Level -> factor for the model's goodput figure at this batch size (1 for a level
        not yet measured enough)."""
        b = batch_bucket(num_seqs)
        running = self._running.get(b)
        out = {m: 1.0 for m in levels}
        if running is None:
            return out
        base = self._efficiency(b, running)
        lo, hi = self.limits
        for m in levels:
            pair = self._pairs.get((b, m))
            if m == running or pair is None or pair[2] < self.min_samples:
                continue
            weight = pair[0]
            shrunk = (pair[1] / weight - base) * weight / (weight + self.prior_steps)
            out[m] = min(hi, max(lo, math.exp(shrunk)))
        return out
