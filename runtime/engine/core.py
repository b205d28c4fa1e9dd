"""One step of speculative decoding, independent of how workers are reached::

    schedule -> propose (every rank of the proposer at once) -> verify (every target
    worker at once, each with the proposals merged into its plan) -> observe (the
    proposer hears the verdicts) -> update (the scheduler applies them)

Every proposer is one ``Proposer`` (``specray.scheduler.proposers.proposer``): the
engine never asks which one it has. Target workers are ``WorkerCall``s
(``specray.runtime.transport.worker_call``): in-process workers run in ``submit``; Ray
workers return references, so all draft ranks (then all target workers) compute in
parallel, and draft probabilities stay ObjectRefs the engine hands on unread.

A step that raises anywhere between its plan and its update keeps nothing: its calls still
out are drained (``specray.runtime.engine.open_calls``), the scheduler requeues its sequences and
narrows down which one made it fail (``specray.scheduler.quarantine``), and ``step`` raises
``StepFailed`` naming the request that failed, if the step ran it alone.
"""

from __future__ import annotations

import time
from functools import partial
from typing import Any, Callable

from specray.runtime.engine.open_calls import OpenCalls
from specray.runtime.engine.predraft_book import PredraftBook, Taken
from specray.runtime.transport.worker_call import WorkerCall, WorkerLost
from specray.scheduler.merge import merge_proposals
from specray.scheduler.messages import StepPlan
from specray.scheduler.proposers.proposer import Proposer, Shard
from specray.scheduler.scheduler import Scheduler
from specray.scheduler.sequence import Sequence
from specray.scheduler.step import ScheduledStep, StepOutcome, Verdict, verdicts


class StepFailed(Exception):
    """A step raised (``cause``) and nothing of it was kept: its sequences were requeued,
    but ``culprit``, the one sequence the step ran (None when it ran several: they are
    tried again in smaller groups), which is finished with reason "error"."""

    def __init__(self, cause: BaseException, culprit: Sequence | None) -> None:
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.cause = cause
        self.culprit = culprit


class Engine:
    def __init__(self, scheduler: Scheduler, verifiers: list[WorkerCall], proposer: Proposer,
                 target_down_timeout_s: float = 120.0, clock: Callable[[], float] = time.perf_counter,
                 overlap: bool = False) -> None:
        """``proposer``: every proposer, one object (``specray.scheduler.proposers.proposer``),
        with one rank per draft plan of a step; ``verifiers[r].wait`` yields a
        ``StepResult``. When every target worker has been down for
        ``target_down_timeout_s``, ``step`` raises instead of waiting forever. ``clock``
        times the phases (a replay passes a simulated one). ``overlap``: a proposer that
        can (``Proposer.can_predraft``) pre-drafts the next window while the target verifies."""
        self.scheduler = scheduler
        self.proposer = proposer
        self.clock = clock
        self.book = PredraftBook() if overlap else None
        self.verifiers = verifiers
        self.target_down_timeout_s = target_down_timeout_s
        self._all_down_since: float | None = None
        self.calls = OpenCalls()

    def step(self) -> list[tuple[Sequence, list[int]]]:
        """Run one step; returns (sequence, tokens appended) for each verified sequence."""
        t0 = self.clock()
        if self.degraded:
            self._check_recovered()
        step = self.scheduler.schedule()
        if step is None:
            if self.book is not None:
                self.book.drop()
            return []
        outcome = StepOutcome(step)
        outcome.times.schedule_s = self.clock() - t0
        try:
            taken = self._take(step, outcome)
            shards = self.propose(step, outcome, skip=set(taken))
            shards += [(t.proposals, t.probs) for t in taken.values()]
            ahead = self._predraft(step, taken, outcome)
            outcome.verdicts = self.verify(step, shards, outcome)
            self.proposer.observe(outcome)
            self._collect(ahead, outcome)
            outcome.times.step_s = self.clock() - t0
            out = self.scheduler.update(outcome)
        except Exception as e:
            raise self._failed(step, outcome, e) from e
        self._learn(out)
        return out

    def _learn(self, out: list[tuple[Sequence, list[int]]]) -> None:
        """The proposer hears of the requests a step finished."""
        for seq, _ in out:
            if seq.finished:
                self.proposer.finished(seq)

    def _failed(self, step: ScheduledStep, outcome: StepOutcome, cause: Exception,
                sent_losses: list[int] | None = None) -> StepFailed:
        """Keep nothing of a step that raised: its calls still out are waited for, the
        workers lost on the way are dealt with as in any step, its pre-drafts are dropped
        and the scheduler requeues its sequences (``Scheduler.step_failed``).
        ``sent_losses``: each draft rank's deaths counted when the step's calls were sent."""
        for kind, r in self.calls.drain(step.step_id):
            if kind == "target":
                outcome.lost_targets.add(r)
            elif self._new_draft_loss(r, sent_losses):
                outcome.lost_drafts.add(r)
        if self.book is not None:
            self.book.drop()
        return StepFailed(cause, self.scheduler.step_failed(step, outcome.lost_drafts, outcome.lost_targets))

    def _new_draft_loss(self, rank: int, sent_losses: list[int] | None) -> bool:
        """Whether a draft worker found lost while draining is a death not counted yet."""
        return True

    def finished(self, seq: Sequence) -> None:
        """A request the driver ended between steps (a stop string): learn from it as from
        any finished one."""
        self.proposer.finished(seq)

    def forget(self, seqs: list[Sequence]) -> None:
        """Requests that ended without a verdict (failed): nothing to learn from them."""
        self.proposer.forget([s.seq_id for s in seqs])

    def propose(self, step: ScheduledStep, outcome: StepOutcome, skip: set[int] = frozenset()) -> list[Shard]:
        """Every rank of the proposer at once (but those in ``skip``)."""
        shards: list[Shard] = []
        if not any(p is not None for r, p in enumerate(step.draft_plans) if r not in skip):
            return shards
        t_draft = self.clock()
        pending = [(r, self._submit_draft(r, p, step)) for r, p in enumerate(step.draft_plans)
                   if p is not None and r not in skip]
        for r, h in pending:
            try:
                shards.append(self.calls.wait(h))
            except WorkerLost:
                # Its sequences verify without proposals this step (plain decoding).
                outcome.lost_drafts.add(r)
        if any(p.seq_ids for p, _ in shards):
            outcome.times.draft_s = self.clock() - t_draft
            # Workers compute in parallel: the slowest one's own time is the phase's compute,
            # the rest of the phase's wall time is messaging.
            outcome.times.draft_compute_s = max(p.compute_s for p, _ in shards)
            outcome.times.mask_s += max(p.mask_s for p, _ in shards)
        return shards

    def _submit_draft(self, r: int, plan: StepPlan, step: ScheduledStep) -> int:
        """Send rank ``r`` of the proposer its plan; returns the call's ticket (``OpenCalls``)."""
        h = self.proposer.submit(r, plan, step.draft_seqs[r])
        return self.calls.sent(step.step_id, "draft", r, partial(self.proposer.wait, r), h)

    def verify(self, step: ScheduledStep, shards: list[Shard], outcome: StepOutcome) -> list[Verdict]:
        """Every target worker at once, each plan with the shards' proposals merged in
        (one shard per sequence)."""
        t1 = self.clock()
        merge_s = 0.0
        pending = []
        # Remote workers first: an in-process one computes in its submit, while they do.
        order = sorted(range(len(step.target_plans)), key=lambda r: getattr(self.verifiers[r], "inline", False))
        for r in order:
            plan = step.target_plans[r]
            if plan is None:
                continue
            probs = []
            if shards and plan.seq_ids:
                t_merge = self.clock()
                mine = set(plan.seq_ids)
                used = [(p, h) for p, h in shards if p.seq_ids and mine.intersection(p.seq_ids)]
                plan = merge_proposals(plan, [p for p, _ in used])
                probs = [h for p, h in used if p.has_probs]
                merge_s += self.clock() - t_merge
            h = self.verifiers[r].submit(plan, probs)
            pending.append((r, plan, self.calls.sent(step.step_id, "target", r, self.verifiers[r].wait, h)))
        out: list[Verdict] = []
        compute_s = mask_s = 0.0
        for r, plan, h in sorted(pending, key=lambda p: p[0]):     # verdicts in rank order, as ever
            try:
                result = self.calls.wait(h)
            except WorkerLost:
                # Its sequences are requeued with every token they had; nothing is lost.
                outcome.lost_targets.add(r)
                continue
            out += verdicts(plan, result)
            compute_s = max(compute_s, result.compute_s)
            mask_s = max(mask_s, result.mask_s)
        outcome.times.merge_s = merge_s
        outcome.times.verify_s = self.clock() - t1 - merge_s
        outcome.times.verify_compute_s = compute_s
        outcome.times.mask_s += mask_s
        return out

    # -- lost workers ------------------------------------------------------------------
    @property
    def degraded(self) -> bool:
        return bool(self.scheduler.drafts_down or self.scheduler.targets_down)

    def dead(self) -> tuple[list[int], list[int]]:
        """Ranks of the draft and target workers that will not come back."""
        return ([r for r in range(self.proposer.num_ranks) if self.proposer.gone(r)],
                [r for r, v in enumerate(self.verifiers) if v.gone()])

    def poll_workers(self) -> None:
        """Take back every lost worker that answers again. Cheap and non-blocking, so the
        driver also calls it while idle: recovery shows in ``metrics()`` without traffic."""
        sched = self.scheduler
        for r in list(sched.drafts_down):
            if self.proposer.alive(r):
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
            outcome.overlap.dropped += dropped
            if got is not None:
                taken[r] = got
                outcome.overlap.used += plan.num_seqs
        self.book.drop()       # a pre-draft serves the step right after it, or none
        return taken

    def _predraft(self, step: ScheduledStep, taken: dict[int, Taken], outcome: StepOutcome) -> list[tuple[int, Any]]:
        """Start each draft worker's pre-draft of this step's outcomes: with the branches
        it adopted, or after the window it just proposed. They run while the target
        verifies."""
        ahead: list[tuple[int, Any]] = []
        proposer = self.proposer
        if self.book is None or not proposer.can_predraft:
            return ahead
        for r, plan in enumerate(step.draft_plans):
            if plan is None or r in outcome.lost_drafts:
                continue
            if r in taken:
                h = proposer.submit_adopt(r, plan, taken[r].chosen)
            elif self.book.wanted(plan):
                h = proposer.submit_predraft(r, plan.step_id)
            else:
                continue
            ahead.append((r, self.calls.sent(step.step_id, "draft", r, partial(proposer.wait_predraft, r), h)))
        return ahead

    def _collect(self, ahead: list[tuple[int, Any]], outcome: StepOutcome) -> None:
        for r, h in ahead:
            try:
                pre, probs = self.calls.wait(h)
            except WorkerLost:
                # A lost pre-draft: the next step drafts as without one. A lost adoption
                # also lost what the worker cached: its sequences catch up from scratch.
                outcome.lost_drafts.add(r)
                continue
            if pre.num_branches:
                self.book.pending[r] = (pre, probs)
                outcome.overlap.predrafted += len(set(pre.seq_ids))
            outcome.overlap.hidden_s = max(outcome.overlap.hidden_s, min(pre.compute_s, outcome.times.verify_s))
