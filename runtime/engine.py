"""One step of speculative decoding, independent of how workers are reached.

    schedule -> propose (every draft worker at once) -> merge -> verify (every target
    worker at once) -> update(StepOutcome)

Workers are reached through ``WorkerCall``s: ``submit`` starts a call and returns a
handle, ``wait`` returns its result. In-process workers simply run in ``submit``; Ray
workers return ObjectRefs, so all draft workers (then all target workers) compute in
parallel, and draft probabilities stay ObjectRefs the engine hands on unread.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Protocol

from specray.scheduler.merge import attach, merge_proposals
from specray.overlap import PredraftBook, Taken
from specray.scheduler.messages import Predraft, Proposals, StepPlan
from specray.scheduler.scheduler import Scheduler
from specray.scheduler.sequence import Sequence
from specray.scheduler.step import ScheduledStep, StepOutcome


class WorkerLost(Exception):
    """A worker died or restarted empty; ``WorkerCall.wait`` raises it."""


class WorkerCall(Protocol):
    def submit(self, plan: StepPlan, *args: Any) -> Any: ...
    def wait(self, handle: Any) -> Any: ...
    def alive(self) -> bool: ...
    def gone(self) -> bool: ...
    def compiled(self) -> bool: ...
    def close(self) -> None: ...


class PredraftCall(Protocol):
    """A draft worker that can pre-draft while the target verifies. Its calls run in the
    order submitted, each after the one before, and do not hold up the caller."""

    def submit_predraft(self, step_id: int) -> Any: ...
    def submit_adopt(self, plan: StepPlan, chosen: list[int]) -> Any: ...
    def wait_predraft(self, handle: Any) -> tuple[Predraft, Any]: ...


class LocalCall:
    """An in-process worker method as a WorkerCall."""

    def __init__(self, fn: Callable) -> None:
        self.fn = fn

    def submit(self, plan: StepPlan, *args: Any) -> Any:
        return self.fn(plan, *args)

    def wait(self, handle: Any) -> Any:
        return handle

    def alive(self) -> bool:
        return True

    def gone(self) -> bool:
        return False

    def compiled(self) -> bool:
        return False

    def close(self) -> None:
        pass


class Engine:
    def __init__(self, scheduler: Scheduler, verifiers: list[WorkerCall], proposers: list[WorkerCall],
                 target_down_timeout_s: float = 120.0, clock: Callable[[], float] = time.perf_counter,
                 overlap: bool = False) -> None:
        """``proposers[r].wait`` yields ``(Proposals, probs handle)``; ``verifiers[r].wait``
        yields a ``StepResult``. When every target worker has been down for
        ``target_down_timeout_s``, ``step`` raises instead of waiting forever. ``clock``
        times the phases (a replay passes a simulated one). ``overlap``: draft workers that
        are ``PredraftCall``s pre-draft the next window while the target verifies."""
        self.scheduler = scheduler
        self.clock = clock
        self.book = PredraftBook() if overlap else None
        self.verifiers = verifiers
        self.proposers = proposers
        self.target_down_timeout_s = target_down_timeout_s
        self._all_down_since: float | None = None

    @property
    def degraded(self) -> bool:
        return bool(self.scheduler.drafts_down or self.scheduler.targets_down)

    def dead(self) -> tuple[list[int], list[int]]:
        """Ranks of the draft and target workers that will not come back."""
        return ([r for r, p in enumerate(self.proposers) if p.gone()],
                [r for r, v in enumerate(self.verifiers) if v.gone()])

    def poll_workers(self) -> None:
        """Take back every lost worker that answers again. Cheap and non-blocking, so the
        driver also calls it while idle: recovery shows in ``metrics()`` without traffic."""
        sched = self.scheduler
        for r in list(sched.drafts_down):
            if self.proposers[r].alive():
                sched.draft_back(r)
        for r in list(sched.targets_down):
            if self.verifiers[r].alive():
                sched.target_back(r)

    def _check_recovered(self) -> None:
        sched = self.scheduler
        self.poll_workers()
        if len(sched.targets_down) < len(self.verifiers):
            self._all_down_since = None
            return
        if all(v.gone() for v in self.verifiers):
            raise RuntimeError("every target worker is dead: Ray restarted each max_worker_restarts times "
                               "and none will come back")
        now = time.monotonic()
        self._all_down_since = self._all_down_since or now
        if now - self._all_down_since > self.target_down_timeout_s:
            raise RuntimeError(f"every target worker has been gone for over {self.target_down_timeout_s:.0f}s")
        time.sleep(0.05)   # nothing can run until one is back

    def step(self) -> list[tuple[Sequence, list[int]]]:
        """Run one step; returns (sequence, tokens appended) for each verified sequence."""
        clock = self.clock
        t0 = clock()
        if self.degraded:
            self._check_recovered()
        step = self.scheduler.schedule()
        if step is None:
            if self.book is not None:
                self.book.drop()
            return []
        outcome = StepOutcome(step, [None] * len(step.target_plans), schedule_s=clock() - t0)
        taken = self._take(step, outcome)
        shards = self.propose(step, outcome, skip=set(taken))
        shards += [(t.proposals, t.probs) for t in taken.values()]
        ahead = self._predraft(step, taken, outcome)
        self.verify(step, shards, outcome)
        self._collect(ahead, outcome)
        outcome.step_s = clock() - t0
        return self.scheduler.update(outcome)

    # -- overlap: pre-drafts taken, made and collected -----------------------------------
    def _take(self, step: ScheduledStep, outcome: StepOutcome) -> dict[int, Taken]:
        """Draft plans whose every sequence a pre-draft already holds proposals for."""
        taken: dict[int, Taken] = {}
        if self.book is None:
            return taken
        for r, plan in enumerate(step.draft_plans):
            if plan is None:
                continue
            got, dropped = self.book.take(r, plan)
            outcome.predraft_dropped += dropped
            if got is not None:
                taken[r] = got
                outcome.predraft_used += plan.num_seqs
        self.book.drop()       # a pre-draft serves the step right after it, or none
        return taken

    def _predraft(self, step: ScheduledStep, taken: dict[int, Taken], outcome: StepOutcome) -> list[tuple[int, Any]]:
        """Start each draft worker's pre-draft of this step's outcomes: with the branches
        it adopted, or after the window it just proposed. They run while the target
        verifies."""
        ahead = []
        if self.book is None:
            return ahead
        for r, plan in enumerate(step.draft_plans):
            if plan is None or not hasattr(self.proposers[r], "submit_predraft") or r in outcome.lost_drafts:
                continue
            call = self.proposers[r]
            if r in taken:
                ahead.append((r, call.submit_adopt(plan, taken[r].chosen)))
            elif self.book.wanted(plan):
                ahead.append((r, call.submit_predraft(plan.step_id)))
        return ahead

    def _collect(self, ahead: list[tuple[int, Any]], outcome: StepOutcome) -> None:
        for r, h in ahead:
            try:
                pre, probs = self.proposers[r].wait_predraft(h)
            except WorkerLost:
                # A lost pre-draft: the next step drafts as without one. A lost adoption
                # also lost what the worker cached: its sequences catch up from scratch.
                outcome.lost_drafts.add(r)
                continue
            if pre.num_branches:
                self.book.pending[r] = (pre, probs)
                outcome.predrafted += len(set(pre.seq_ids))
            outcome.draft_hidden_s = max(outcome.draft_hidden_s, min(pre.compute_s, outcome.verify_s))

    def propose(self, step: ScheduledStep, outcome: StepOutcome, skip: set[int] = frozenset()
                ) -> list[tuple[Proposals, Any]]:
        """Every draft worker at once (but those in ``skip``); returns (proposals,
        probabilities handle) per shard."""
        shards: list[tuple[Proposals, Any]] = []
        if not any(p is not None for r, p in enumerate(step.draft_plans) if r not in skip):
            return shards
        t_draft = self.clock()
        pending = [(r, self.proposers[r].submit(p)) for r, p in enumerate(step.draft_plans)
                   if p is not None and r not in skip]
        for r, h in pending:
            try:
                shards.append(self.proposers[r].wait(h))
            except WorkerLost:
                # Its sequences verify without proposals this step (plain decoding).
                outcome.lost_drafts.add(r)
        if any(p.seq_ids for p, _ in shards):
            outcome.draft_s = self.clock() - t_draft
            # Workers compute in parallel: the slowest one's own time is the phase's compute,
            # the rest of the phase's wall time is messaging.
            outcome.draft_compute_s = max(p.compute_s for p, _ in shards)
        return shards

    def verify(self, step: ScheduledStep, shards: list[tuple[Proposals, Any]], outcome: StepOutcome) -> None:
        """Merge the proposals into each target plan, then every target worker at once."""
        t1 = self.clock()
        pending = []
        for r, plan in enumerate(step.target_plans):
            if plan is None:
                continue
            probs = []
            if shards and plan.seq_ids:
                t_merge = self.clock()
                mine = set(plan.seq_ids)
                used = [(p, h) for p, h in shards if p.seq_ids and mine.intersection(p.seq_ids)]
                merged = merge_proposals(plan.seq_ids, plan.k, [p for p, _ in used])
                attach(plan, merged)
                outcome.confidence.update(merged.confidence)
                probs = [h for p, h in used if p.has_probs]
                outcome.merge_s += self.clock() - t_merge
            pending.append((r, self.verifiers[r].submit(plan, probs)))
        for r, h in pending:
            try:
                outcome.results[r] = self.verifiers[r].wait(h)
            except WorkerLost:
                # Its sequences are requeued with every token they had; nothing is lost.
                outcome.lost_targets.add(r)
        outcome.verify_s = self.clock() - t1 - outcome.merge_s
        outcome.verify_compute_s = max((res.compute_s for res in outcome.results if res is not None), default=0.0)
