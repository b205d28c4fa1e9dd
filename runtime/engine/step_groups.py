"""Two groups in flight: while the target verifies one group of sequences, the draft
proposes for the other, then they swap (the actor layout, batch >= 2).

Each ``step()`` plans a new group from the running sequences that have no step in flight
(plus admissions), sends its draft call, and then lands the group planned one step
earlier: waits for its proposals (drafted while the previous group was verified), verifies
it (an in-process target computes while the draft works on the new group) and updates the
scheduler. So every draft call but the first is in flight while the target computes::

    draft:   [A1] [B1]      [A2]      [B2] ...
    target:       [A1 .. ]  [B1 .. ]  [A2 ..] ...

Every sequence is verified against exactly what it proposed, and each worker receives its
plans in the order the scheduler made them (frees and block reuse travel with plans), so
outputs do not change. A sequence with a step in flight is never planned, preempted or
admitted again until that step lands (``Scheduler.schedule(in_flight=...)``); a lost
worker's in-flight sequences are recomputed like any other it held.

With one sequence (or none) to run and nothing in flight, a step is the serial one
(``Engine.step``, with pre-drafting where it is on): there is no second group.

A group that fails (its draft calls cannot be sent, or its landing raises) fails alone, as
a serial step does (``Engine._failed``): the other group stays in flight and lands next.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from specray.runtime.config import RuntimeConfig
from specray.runtime.engine.core import Engine
from specray.runtime.transport.worker_call import WorkerLost
from specray.scheduler.sequence import Sequence
from specray.scheduler.step import ScheduledStep, StepOutcome


@dataclass
class Flight:
    """A group planned and sent to the draft workers, not verified yet."""

    step: ScheduledStep
    outcome: StepOutcome
    drafts: list[tuple[int, Any]] = field(default_factory=list)     # (draft rank, call ticket)
    draft_losses: list[int] = field(default_factory=list)           # each draft rank's, when sent

    @property
    def seq_ids(self) -> frozenset[int]:
        return frozenset(s.seq_id for s in self.step.seqs)


def wants_groups(config: RuntimeConfig) -> bool:
    """Whether this driver's engine keeps two groups in flight: where draft and target are
    different processes (the actor layout) and the draft model proposes alone."""
    spec = config.speculation
    return (config.cluster.layout == "actors" and config.cluster.groups_in_flight == 2 and spec.proposer == "draft"
            and spec.num_speculative_tokens > 0)


class GroupEngine(Engine):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.flight: Flight | None = None
        self.num_group_steps = 0      # steps landed while the other group was in flight
        self.draft_losses = [0] * self.proposer.num_ranks     # deaths seen per draft rank

    def step(self) -> list[tuple[Sequence, list[int]]]:
        t0 = self.clock()
        if self.degraded:
            self._check_recovered()
        sched = self.scheduler
        if self.flight is None and min(len(sched.running) + len(sched.waiting), sched.cache.max_num_seqs) <= 1:
            return super().step()
        if self.book is not None:
            self.book.drop()      # pre-drafts serve serial steps only
        new = self._launch(t0)
        if self.flight is None:
            if new is None:
                return []
            self.flight = new
            new = self._launch(self.clock())      # raising StepFailed, the first lands next step
        done, self.flight = self.flight, new
        self.num_group_steps += new is not None
        return self._land(done, t0)

    def _launch(self, t0: float) -> Flight | None:
        """Plan a group (at most half of what may run: the other half is, or will be, the
        other group) and send its draft calls."""
        sched = self.scheduler
        busy = self.flight.seq_ids if self.flight is not None else frozenset()
        total = min(len(sched.running) + len(sched.waiting), sched.cache.max_num_seqs)
        step = sched.schedule(busy, max_seqs=max(1, math.ceil(total / 2)))
        if step is None:
            return None
        outcome = StepOutcome(step)
        outcome.times.schedule_s = self.clock() - t0
        sent = list(self.draft_losses)
        try:
            drafts = [(r, self._submit_draft(r, p, step)) for r, p in enumerate(step.draft_plans) if p is not None]
        except Exception as e:
            raise self._failed(step, outcome, e, sent) from e
        return Flight(step, outcome, drafts, sent)

    def _land(self, f: Flight, t0: float) -> list[tuple[Sequence, list[int]]]:
        """Wait for the group's proposals, verify it and update the scheduler."""
        try:
            out = self._verify_group(f, t0)
        except Exception as e:
            raise self._failed(f.step, f.outcome, e, f.draft_losses) from e
        self._learn(out)
        return out

    def _new_draft_loss(self, rank: int, sent_losses: list[int] | None) -> bool:
        # A death already seen since the failed group's calls were sent is counted once.
        if sent_losses is not None and self.draft_losses[rank] != sent_losses[rank]:
            return False
        self.draft_losses[rank] += 1
        return True

    def _verify_group(self, f: Flight, t0: float) -> list[tuple[Sequence, list[int]]]:
        sched, step, outcome = self.scheduler, f.step, f.outcome
        t_draft = self.clock()
        shards, stale = [], []
        for r, h in f.drafts:
            try:
                shards.append(self.calls.wait(h))
            except WorkerLost:
                # Its sequences verify without proposals (plain decoding). A death already
                # seen since this call was sent (by the other group's) is counted once.
                if self.draft_losses[r] == f.draft_losses[r]:
                    outcome.lost_drafts.add(r)
                    self.draft_losses[r] += 1
                else:
                    stale.append(r)
        if any(p.seq_ids for p, _ in shards):
            waited = self.clock() - t_draft
            compute = max(p.compute_s for p, _ in shards)
            # The draft computed mostly while the other group was verified: the step only
            # waited for what was left of it.
            outcome.times.draft_s = waited
            outcome.times.draft_compute_s = min(compute, waited)
            outcome.times.mask_s += max(p.mask_s for p, _ in shards)
            outcome.overlap.hidden_s = max(0.0, compute - waited)
        for r in sched.targets_down:
            # Lost since this group was planned: its sequences there were requeued.
            if r < len(step.target_plans):
                step.target_plans[r] = None
        outcome.verdicts = self.verify(step, shards, outcome)
        self.proposer.observe(outcome)
        outcome.times.step_s = self.clock() - t0
        out = sched.update(outcome)
        for r in stale:
            for seq in step.draft_seqs[r]:
                seq.draft_computed = 0       # its worker died after this call was sent: it holds nothing
        return out
