"""One step of speculative decoding, independent of how workers are reached.

    schedule -> propose -> merge -> verify -> update

``propose`` and ``verify`` are callables: plain method calls on in-process workers, or Ray
actor calls (where draft probabilities stay ObjectRefs the engine passes along unread).
"""

from __future__ import annotations

import time
from typing import Any, Callable

from scheduler.merge import merge_proposals
from scheduler.messages import Proposals, StepPlan, StepResult
from scheduler.scheduler import Scheduler
from scheduler.sequence import Sequence

ProposeFn = Callable[[StepPlan], tuple[Proposals, Any]]
VerifyFn = Callable[[StepPlan, list], StepResult]


class Engine:
    def __init__(self, scheduler: Scheduler, verify: VerifyFn, propose: ProposeFn | None = None) -> None:
        self.scheduler = scheduler
        self.verify = verify
        self.propose = propose

    def step(self) -> list[tuple[Sequence, list[int]]]:
        """Run one step; returns (sequence, tokens appended) for each scheduled sequence."""
        t0 = time.perf_counter()
        step = self.scheduler.schedule()
        if step is None:
            return []
        probs: list = []
        draft_s = None
        if step.draft is not None and self.propose is not None:
            t1 = time.perf_counter()
            proposals, handle = self.propose(step.draft)
            draft_s = time.perf_counter() - t1 if step.draft.seq_ids else None
            shards = [proposals] if proposals.seq_ids else []
            if proposals.has_probs:
                probs.append(handle)
            self.scheduler.attach_proposals(step, merge_proposals(step.target.seq_ids, step.target.k, shards))
        t2 = time.perf_counter()
        result = self.verify(step.target, probs)
        self.scheduler.stats.record_phases(draft_s, time.perf_counter() - t2)
        return self.scheduler.update(step, result, time.perf_counter() - t0)

    def run_until_done(self) -> None:
        while self.scheduler.has_work:
            self.step()
