"""Speculation on or off for the whole batch: the cost model's expected goodput of each
mode, corrected by how far off its predictions for that mode have been measured to be.
The last word when the cost model is wrong (a machine's step time is not linear in
anything, and other load moves it)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from specray.scheduler.adaptive.outcome_sums import OutcomeSums
from specray.scheduler.adaptive.step_cost import batch_bucket


@dataclass
class GoodputSwitch:
    """Per bucket of batch sizes (1, 2-3, 4-7, ...) and per mode, discounted sums of how
    long recent decode steps took and how long the model predicted. Their ratio
    (predicted over measured, 1 while unmeasured) scales the model's goodput figure for
    the batch at hand, and the mode whose corrected figure is ahead runs.

    Only time is checked. What a step emits is the acceptance estimates' business, per
    sequence; a bucket's ratio of emitted to expected tokens would mostly say which
    sequences happened to run at that size: a batch drains to its slowest acceptors, and a
    correction made of them keeps later requests plain (docs/adaptive-policy.md).

    Now and then one step runs the other mode, so its correction stays current (the
    machine's load and the batch's lengths drift): after ``explore_every`` steps; each
    trial whose step did worse than the leader's corrected figure doubles the wait, up to
    ``max_explore_every``, and one that did better brings the next trial back soon. A
    trial's time comes without the draft's catch-up on what it skipped (see
    ``AdaptivePolicy.observe_step``). A trial step weighs like any other: at small
    batch one step's tokens swing from 1 to k+1, and a single unlucky step must not flip
    the mode.

    The machine's speed drifts, for both modes alike, and the mode not running is measured
    only in its trials. Its own sums would compare a trial from a fast spell with the
    leader's steps in a slow one. So a trial is judged paired: its
    ratio against the leader's ratio of the moment (``pair_decay``: how fast older pairs
    fade), and the other mode's correction is the leader's current one times that
    relative figure. A slowdown of the leader alone is then read as the machine's, until
    a trial says otherwise; so once the leader has slowed enough since the last pairing
    that a slowdown of its own would flip the decision, the other mode is tried at once."""

    explore_every: int = 16
    max_explore_every: int = 256
    decay: float = 0.9               # about the last ten steps of the running mode count
    min_samples: int = 3
    pair_decay: float = 0.7          # about the last three trial pairs count
    _sums: OutcomeSums = field(init=False)      # per (bucket, speculated)
    _steps: dict[int, int] = field(default_factory=dict)
    _next_trial: dict[int, int] = field(default_factory=dict)
    _wait: dict[int, int] = field(default_factory=dict)
    _trial: dict[int, float] = field(default_factory=dict)   # bucket -> the leader's figure at a trial
    _lead: dict[int, bool] = field(default_factory=dict)     # bucket -> the mode its last non-trial step ran
    # bucket -> [weight, weighted sum of log(on's ratio / off's ratio)] over paired trials
    _pairs: dict[int, list[float]] = field(default_factory=dict)
    _paired_at: dict[int, float] = field(default_factory=dict)   # bucket -> the leader's ratio then
    _tried_at: dict[int, int] = field(default_factory=dict)      # bucket -> the step of its last trial

    def __post_init__(self) -> None:
        self._sums = OutcomeSums(self.decay)
        if not 0.0 <= self.pair_decay < 1.0:
            raise ValueError(f"pair_decay must be in [0, 1), got {self.pair_decay}")

    @staticmethod
    def bucket(num_seqs: int) -> int:
        return batch_bucket(num_seqs)

    def correction(self, num_seqs: int, speculate: bool) -> float:
        """Predicted over measured time of this mode at this batch size, else at a
        neighbouring bucket's (a batch that drains or grows through buckets starts from
        what its neighbour learned); 1 while nothing close is known."""
        b = self.bucket(num_seqs)
        for near in (b, b - 1, b + 1):
            ratio = self._ratio(near, speculate)
            if ratio is not None:
                return ratio
        return 1.0

    def _ratio(self, b: int, speculate: bool) -> float | None:
        lead = self._lead.get(b)
        pair = self._pairs.get(b)
        if lead is not None and lead != speculate and pair is not None:
            led = self._sums.ratio((b, lead), self.min_samples)
            if led is not None:
                relative = math.exp(pair[1] / pair[0])       # on's ratio over off's
                return led * relative if speculate else led / relative
        return self._sums.ratio((b, speculate), self.min_samples)

    def goodput(self, num_seqs: int, speculate: bool, predicted: float) -> float:
        return predicted * self.correction(num_seqs, speculate)

    def speculate(self, num_seqs: int, on_goodput: float, off_goodput: float) -> bool:
        """``on_goodput``, ``off_goodput``: the model's expected tokens per second of this
        batch with its best speculating choice and without speculation."""
        b = self.bucket(num_seqs)
        self._steps[b] = self._steps.get(b, 0) + 1
        on, off = self.goodput(num_seqs, True, on_goodput), self.goodput(num_seqs, False, off_goodput)
        ahead = on >= off
        due = self._steps[b] >= self._next_trial.setdefault(b, self._steps[b] + self.explore_every)
        if due:
            # One trial step. The next is scheduled now, not when this one is observed: a
            # step the switch never sees (one that prefills too) must not leave every
            # following step on trial.
            self._next_trial[b] = self._steps[b] + self._wait.get(b, self.explore_every)
        if due or self._doubted(b, ahead, on, off):
            self._trial[b] = max(on, off)
            self._tried_at[b] = self._steps[b]
            return not ahead
        self._trial.pop(b, None)
        return ahead

    def _doubted(self, b: int, ahead: bool, on: float, off: float) -> bool:
        """Whether the leader has slowed since the last pairing by enough that, were the
        slowdown its own and not the machine's, the other mode would now be ahead. Then
        the other mode is tried now (once: the doubt is reset here), unless a trial ran in
        the last ``explore_every`` steps: at batch 1 the machine's spells raised doubts
        every few dozen steps, each a step of the slower mode (in process, 20 requests: 43
        of 439 steps plain; with this limit 15 of 434, as many as with no trials at all)."""
        if self._lead.get(b) != ahead or b not in self._paired_at:
            return False
        if self._steps[b] - self._tried_at.get(b, -self.explore_every) < self.explore_every:
            return False
        now = self._sums.ratio((b, ahead), self.min_samples)
        if now is None:
            return False
        slowed = now / self._paired_at[b]
        if slowed >= 1.0 or max(on, off) * slowed >= min(on, off):
            return False
        self._paired_at[b] = now
        return True

    def observe(self, num_seqs: int, speculated: bool, tokens: int, seconds: float, predicted_seconds: float) -> None:
        """A decode step's tokens and time, and the time the model predicted for it (the
        tokens judge a trial against the leader's figure; the correction reads time)."""
        b = self.bucket(num_seqs)
        lead = self._trial.pop(b, None)
        if lead is not None:
            wait = self._wait.get(b, self.explore_every)
            wait = self.explore_every if tokens / seconds > lead else min(2 * wait, self.max_explore_every)
            self._wait[b] = wait
            self._next_trial[b] = self._steps.get(b, 0) + wait
            led = self._sums.ratio((b, not speculated), self.min_samples)
            if led is not None and self._lead.get(b) == (not speculated):
                ratio = predicted_seconds / seconds
                sample = math.log(ratio / led) if speculated else math.log(led / ratio)
                pair = self._pairs.setdefault(b, [0.0, 0.0])
                pair[0] = pair[0] * self.pair_decay + 1.0
                pair[1] = pair[1] * self.pair_decay + sample
                self._paired_at[b] = led
        else:
            self._lead[b] = speculated
        self._sums.add((b, speculated), seconds, predicted_seconds)
