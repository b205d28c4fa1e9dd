"""Speculation on or off for the whole batch: the cost model's expected goodput of each
mode, corrected by how far off its predictions for that mode have been measured to be.
The last word when the cost model is wrong (a machine's step time is not linear in
anything, and other load moves it)."""

from __future__ import annotations

from dataclasses import dataclass, field

from scheduler.outcome_sums import OutcomeSums
from scheduler.step_cost import batch_bucket


@dataclass
class GoodputSwitch:
    """Per bucket of batch sizes (1, 2-3, 4-7, ...) and per mode, discounted sums of what
    recent decode steps emitted and took, and of what the model predicted for them. Their
    ratio, measured over predicted goodput (1 while unmeasured), scales the model's figure
    for the batch at hand, and the mode whose corrected figure is ahead runs.

    Raw tokens per second would compare different batches: a batch drained to its slowest,
    least predictable sequences makes speculation look bad at that size for the next,
    easy batch. The ratio compares each mode with what the model expected of the same
    sequences.

    Now and then one step runs the other mode, so its correction stays current (the
    machine's load and the batch's lengths drift): after ``explore_every`` steps; each
    trial whose step did worse than the leader's corrected figure doubles the wait, up to
    ``max_explore_every`` (a trial can cost several plain steps: the draft catches up on
    what it skipped), and one that did better brings the next trial back soon. A trial
    step weighs like any other: at small batch one step's tokens swing from 1 to k+1, and
    a single unlucky step must not flip the mode."""

    explore_every: int = 16
    max_explore_every: int = 256
    decay: float = 0.9               # about the last ten steps of the running mode count
    min_samples: int = 3
    _sums: OutcomeSums = field(init=False)      # per (bucket, speculated)
    _steps: dict[int, int] = field(default_factory=dict)
    _next_trial: dict[int, int] = field(default_factory=dict)
    _wait: dict[int, int] = field(default_factory=dict)
    _trial: dict[int, float] = field(default_factory=dict)   # bucket -> the leader's figure at a trial

    def __post_init__(self) -> None:
        self._sums = OutcomeSums(self.decay)

    @staticmethod
    def bucket(num_seqs: int) -> int:
        return batch_bucket(num_seqs)

    def correction(self, num_seqs: int, speculate: bool) -> float:
        """Measured over predicted goodput of this mode at this batch size, else at a
        neighbouring bucket's (a batch that drains or grows through buckets starts from
        what its neighbour learned); 1 while nothing close is known."""
        b = self.bucket(num_seqs)
        for near in (b, b - 1, b + 1):
            ratio = self._sums.ratio((near, speculate), self.min_samples)
            if ratio is not None:
                return ratio
        return 1.0

    def goodput(self, num_seqs: int, speculate: bool, predicted: float) -> float:
        return predicted * self.correction(num_seqs, speculate)

    def speculate(self, num_seqs: int, on_goodput: float, off_goodput: float) -> bool:
        """``on_goodput``, ``off_goodput``: the model's expected tokens per second of this
        batch with its best speculating choice and without speculation."""
        b = self.bucket(num_seqs)
        self._steps[b] = self._steps.get(b, 0) + 1
        on, off = self.goodput(num_seqs, True, on_goodput), self.goodput(num_seqs, False, off_goodput)
        ahead = on >= off
        if self._steps[b] >= self._next_trial.setdefault(b, self._steps[b] + self.explore_every):
            # One trial step. The next is scheduled now, not when this one is observed: a
            # step the switch never sees (one that prefills too) must not leave every
            # following step on trial.
            self._next_trial[b] = self._steps[b] + self._wait.get(b, self.explore_every)
            self._trial[b] = max(on, off)
            return not ahead
        self._trial.pop(b, None)
        return ahead

    def observe(self, num_seqs: int, speculated: bool, tokens: int, seconds: float,
                predicted_tokens: float, predicted_seconds: float) -> None:
        b = self.bucket(num_seqs)
        lead = self._trial.pop(b, None)
        if lead is not None:
            wait = self._wait.get(b, self.explore_every)
            wait = self.explore_every if tokens / seconds > lead else min(2 * wait, self.max_explore_every)
            self._wait[b] = wait
            self._next_trial[b] = self._steps.get(b, 0) + wait
        self._sums.add((b, speculated), tokens, seconds, predicted_tokens, predicted_seconds)
