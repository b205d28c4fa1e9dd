"""Continuous batching with per-sequence proposal lengths and lookahead reservation,
over any number of target and draft workers.

Each step::

    schedule()        -> ScheduledStep: one plan per target worker, one per draft worker
    workers           -> Proposals (per draft worker), verdicts (per target worker)
    update(outcome)   -> sequences advanced, finished ones released

How many tokens each sequence proposes is its ``SpeculationPolicy``'s call (``decide``
before planning, ``observe`` after the verdicts); the scheduler bounds it by each
sequence's ``proposal_limit`` and reserves the slots.

Every sequence lives on one target worker and one draft worker (its ranks), chosen when
it is admitted — the least loaded by tokens where it fits — and kept while it runs, so
each worker keeps its sequences' KV. Target workers are data parallel: each verifies only
its own sequences.

Running sequences are served oldest first and keep their place; when a target pool
cannot hold a sequence's slots the newest running sequence of that pool is preempted
(its KV is dropped everywhere and it is recomputed from its tokens later:
``computed = 0``). A draft pool that is short only turns speculation off for that
sequence this step. Waiting requests join with what is left. Nothing is ever dropped: a
preempted sequence goes back to the front of the queue with every token it emitted.

A step that fails is requeued the same way (``step_failed``), and its sequences are tried
in smaller groups until the one that fails alone is found (``Quarantine``).
"""

from __future__ import annotations

from collections import deque

from specray.scheduler.block_manager import BlockManager
from specray.scheduler.config import CacheConfig, SpeculationConfig
from specray.scheduler.grammar_plan import add_grammars
from specray.scheduler.messages import StepPlan
from specray.scheduler.quarantine import Quarantine
from specray.scheduler.sequence import Sequence, SequenceStatus
from specray.scheduler.speculation_policy import Decision, PolicyView, SpeculationPolicy, StaticPolicy
from specray.scheduler.stats import SpecStats
from specray.scheduler.step import ScheduledStep, StepOutcome


class Scheduler:
    def __init__(self, cache: CacheConfig, speculation: SpeculationConfig, max_model_len: int,
                 target_pools: BlockManager | list[BlockManager], draft_pools: BlockManager | list[BlockManager] |
                 None = None, *, draft_max_model_len: int | None = None, num_proposers: int = 1,
                 policy: SpeculationPolicy | None = None) -> None:
        """``max_model_len``: the window in force (the target's, or less); ``draft_max_model_len``:
        the draft's (None: a proposer without one, such as n-gram lookup). ``draft_pools``:
        the draft workers' pools (None for a proposer without KV, of which there are
        ``num_proposers``). ``policy``: what each sequence proposes (default: static)."""
        if max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {max_model_len}")
        self.cache = cache
        self.speculation = speculation
        self.max_model_len = max_model_len
        self.draft_max_model_len = draft_max_model_len
        self.num_speculative_tokens = speculation.num_speculative_tokens
        self.policy: SpeculationPolicy = policy if policy is not None else StaticPolicy(speculation)
        self.target_pools = _as_list(target_pools)
        self.draft_pools = _as_list(draft_pools) if draft_pools is not None else []
        if not self.target_pools:
            raise ValueError("at least one target pool is needed")
        self.num_draft_ranks = (len(self.draft_pools) or num_proposers) if self.num_speculative_tokens else 0
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.stats = SpecStats(self.num_speculative_tokens)
        self._step_id = 0
        self._draft_slots: dict[int, int] = {}     # this step's draft reservations (_reserve)
        # Frees the workers have not been told about yet; they travel with the next plan.
        self._target_frees: list[list[int]] = [[] for _ in self.target_pools]
        self._draft_frees: list[list[int]] = [[] for _ in range(self.num_draft_ranks)]
        self.drafts_down: set[int] = set()   # draft workers lost and not back yet
        self.targets_down: set[int] = set()  # target workers lost and not back yet
        self.quarantine = Quarantine()       # sequences of failed steps, run apart until cleared

    # -- requests ------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        if seq.num_tokens >= self.max_model_len:
            raise ValueError(f"prompt of {seq.num_tokens} tokens leaves no room below max_model_len "
                             f"{self.max_model_len}")
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- planning ------------------------------------------------------------------
    def proposal_limit(self, seq: Sequence) -> int:
        """The most ``seq`` may propose this step: at most ``num_speculative_tokens``,
        leaving room for the target's own token inside ``max_tokens`` and
        ``max_model_len``, and 0 where the draft cannot see that far or is down, or where
        the request asked to decode plainly (``SamplingParams.speculation``)."""
        if self.num_speculative_tokens == 0 or seq.draft_rank in self.drafts_down or not seq.params.speculation:
            return 0
        n = seq.num_tokens
        limit = min(self.num_speculative_tokens, seq.remaining - 1, self.max_model_len - n - 1)
        if self.draft_max_model_len is not None and n + limit > self.draft_max_model_len:
            # Past the draft's window the draft cannot propose: the sequence decodes without it.
            return 0
        return max(limit, 0)

    def _draft_pool(self, seq: Sequence) -> BlockManager | None:
        return self.draft_pools[seq.draft_rank] if self.draft_pools else None

    def _reserve(self, seq: Sequence, proposal_len: int) -> int | None:
        """Reserve slots for one step; returns the proposal_len that fits (draft shortfalls
        lower it to 0, which needs no draft slots) or None when the target cannot hold
        even the fed tokens."""
        num_tokens, sid = seq.num_tokens, seq.seq_id
        target = self.target_pools[seq.target_rank]
        draft = self._draft_pool(seq)
        # The draft writes each proposal but the last; the target every proposal.
        if proposal_len > 0 and draft is not None and not draft.can_allocate_slots(sid, num_tokens, proposal_len - 1):
            proposal_len = 0
        if not target.allocate_slots(sid, num_tokens, proposal_len):
            if proposal_len == 0 or not target.allocate_slots(sid, num_tokens):
                return None
            proposal_len = 0
        if proposal_len > 0 and draft is not None:
            lookahead = proposal_len - 1
            # Overlap: also a pre-draft of the next window (proposal_len + 1 past its own:
            # the last proposal, the guess of the target's token and proposal_len - 1
            # passes), where it fits.
            ahead = 2 * proposal_len
            if (self.speculation.overlap
                    and (self.draft_max_model_len is None or num_tokens + ahead <= self.draft_max_model_len)
                    and draft.allocate_slots(sid, num_tokens, ahead)):
                lookahead = ahead
            else:
                draft.allocate_slots(sid, num_tokens, lookahead)
            self._draft_slots[sid] = num_tokens + lookahead
        return proposal_len

    def _preempt(self, seq: Sequence, counted: bool = True) -> None:
        """``counted``: a preemption in the stats (not a failed step's requeue)."""
        self.running.remove(seq)
        self._release(seq)
        seq.reset_computed()
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.stats.num_preemptions += counted
        # Preempted sequences wait at the front, oldest first, so each keeps its priority.
        i = 0
        while i < len(self.waiting) and self.waiting[i].num_preemptions and self.waiting[i].seq_id < seq.seq_id:
            i += 1
        self.waiting.insert(i, seq)

    def _release(self, seq: Sequence) -> None:
        # Workers ignore frees of sequences they never saw, so telling them is always safe.
        self.target_pools[seq.target_rank].free(seq.seq_id)
        self._target_frees[seq.target_rank].append(seq.seq_id)
        if self.num_draft_ranks:
            pool = self._draft_pool(seq)
            if pool is not None:
                pool.free(seq.seq_id)
            # Not to a draft worker that is down: it comes back empty, and a queued free
            # would be a plan -- a call -- to a dead worker.
            if seq.draft_rank not in self.drafts_down:
                self._draft_frees[seq.draft_rank].append(seq.seq_id)

    def _place(self, seq: Sequence, t_load: list[int], d_load: list[int]) -> None:
        """Pick the least loaded target and draft worker (by tokens) for a newcomer; a
        target pool it fits in beats one it does not."""
        n = seq.num_tokens
        seq.target_rank = min(range(len(t_load)), key=lambda r: (
            r in self.targets_down, not self.target_pools[r].can_allocate_slots(seq.seq_id, n), t_load[r], r))
        seq.draft_rank = min(range(len(d_load)), key=lambda r: (r in self.drafts_down, d_load[r], r))
        t_load[seq.target_rank] += n
        d_load[seq.draft_rank] += n

    def _decide(self, running: list[Sequence]) -> Decision:
        """The policy's proposal lengths for the running sequences this step plans and for
        newcomers."""
        if self.num_speculative_tokens == 0:
            return Decision([0] * len(running))
        view = PolicyView(seq_ids=[s.seq_id for s in running],
                          proposal_limits=[self.proposal_limit(s) for s in running],
                          fed_tokens=sum(s.num_tokens - s.target_computed for s in running),
                          batch_size=self._reachable_batch())
        decision = self.policy.decide(view)
        if len(decision.proposal_lens) != len(running) or any(
                not 0 <= n <= limit for n, limit in zip(decision.proposal_lens, view.proposal_limits)):
            raise ValueError(f"policy decided proposal_lens {decision.proposal_lens} for limits "
                             f"{view.proposal_limits}")
        return decision

    def _reachable_batch(self) -> int:
        """The batch this step may reach once the waiting requests are admitted."""
        return min(len(self.running) + len(self.waiting), self.cache.max_num_seqs)

    def schedule(self, in_flight: frozenset[int] = frozenset(), max_seqs: int | None = None) -> ScheduledStep | None:
        """The next step. ``in_flight``: sequences whose step is still being computed (a
        group in flight): they keep their reservations and are neither planned, preempted
        nor counted out of ``max_num_seqs``. ``max_seqs``: at most this many sequences in
        the step (a group's share; the running ones left out join a later step). While
        there are suspects of a failed step, the step runs only the next group of them
        (the others running wait, keeping their KV); a group that cannot run now is let
        go (its sequences run as any others)."""
        only = self._probe(in_flight)
        step = self._schedule(in_flight, max_seqs, only)
        if step is None and only is not None and len(self.targets_down) < len(self.target_pools):
            self.quarantine.passed(only)
            return self._schedule(in_flight, max_seqs, self._probe(in_flight))
        return step

    def _probe(self, in_flight: frozenset[int]) -> frozenset[int] | None:
        if not self.quarantine:
            return None
        return self.quarantine.probe({s.seq_id for s in self.running} | {s.seq_id for s in self.waiting}, in_flight)

    def _schedule(self, in_flight: frozenset[int], max_seqs: int | None, only: frozenset[int] | None
                  ) -> ScheduledStep | None:
        batch: list[tuple[Sequence, int]] = []
        preempted = False
        self._draft_slots.clear()
        free = [s for s in self.running if s.seq_id not in in_flight and (only is None or s.seq_id in only)]
        cap = self.cache.max_num_seqs - (len(self.running) - len(free))
        if max_seqs is not None:
            free, cap = free[:max_seqs], min(cap, max_seqs)
        decision = self._decide(free)
        proposal_lens = dict(zip((s.seq_id for s in free), decision.proposal_lens))
        queue = list(free)
        while queue:
            seq = queue.pop(0)
            proposal_len = self._reserve(seq, proposal_lens[seq.seq_id])
            while proposal_len is None:
                same_pool = [s for s in queue if s.target_rank == seq.target_rank]
                victim = same_pool[-1] if same_pool else seq
                if victim is not seq:
                    queue.remove(victim)
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
                proposal_len = self._reserve(seq, proposal_lens[seq.seq_id])
            if proposal_len is not None:
                batch.append((seq, proposal_len))

        budget = self.cache.max_num_batched_tokens - sum(s.num_tokens - s.target_computed for s, _ in batch)
        t_load = [0] * len(self.target_pools)
        d_load = [0] * max(self.num_draft_ranks, 1)
        for s in self.running:
            t_load[s.target_rank] += s.num_tokens
            d_load[s.draft_rank] += s.num_tokens
        # No admissions in a step that had to preempt (that would thrash), unless nothing
        # runs at all: then a sequence that outgrew its pool is placed again, maybe elsewhere.
        admit = self.waiting if only is None else deque(s for s in self.waiting if s.seq_id in only)
        while admit and not (preempted and batch) and len(batch) < cap:
            seq = admit[0]
            if seq.seq_id in in_flight:
                break      # preempted (a lost worker) while its step is in flight: it waits for that step
            cost = seq.num_tokens - seq.target_computed
            if batch and cost > budget:
                break
            self._place(seq, t_load, d_load)
            if seq.target_rank in self.targets_down:
                break   # every target worker is down: wait for one to come back
            proposal_len = self._reserve(seq, min(self.proposal_limit(seq), decision.newcomer_proposal_len))
            if proposal_len is None:
                break
            admit.popleft()
            if admit is not self.waiting:
                self.waiting.remove(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.append((seq, proposal_len))
            budget -= cost

        if not batch:
            if self.waiting and not self.running and only is None and len(self.targets_down) < len(self.target_pools):
                seq = self.waiting[0]
                pool = self.target_pools[seq.target_rank]
                raise RuntimeError(f"KV pool too small: request {seq.request_id} needs "
                                   f"{pool.blocks_needed(seq.num_tokens)} blocks, the pool has {pool.num_blocks}")
            return None
        return self._build(batch)

    def _build(self, batch: list[tuple[Sequence, int]]) -> ScheduledStep:
        self._step_id += 1
        sid = self._step_id
        t_plans: list[StepPlan | None] = [None] * len(self.target_pools)
        t_seqs: list[list[Sequence]] = [[] for _ in self.target_pools]
        d_plans: list[StepPlan | None] = [None] * self.num_draft_ranks
        d_seqs: list[list[Sequence]] = [[] for _ in range(self.num_draft_ranks)]
        # Every plan of a step shares one width (proposals and draft probabilities are
        # [n, width] grids): the longest proposal_len this step, not num_speculative_tokens.
        # A step where nobody proposes then scores one row per sequence, as plain decoding
        # does, instead of num_speculative_tokens + 1.
        width = max((proposal_len for _, proposal_len in batch), default=0)
        for seq, proposal_len in batch:
            seq.step_len = seq.num_tokens
            seq.proposal_len = proposal_len
            t = seq.target_rank
            if t_plans[t] is None:
                t_plans[t] = StepPlan(step_id=sid, width=width)
            _add_seq(t_plans[t], seq, seq.target_computed, seq.step_len + proposal_len, proposal_len)
            t_plans[t].logprobs.append(-1 if seq.params.logprobs is None else seq.params.logprobs)
            t_seqs[t].append(seq)
            if proposal_len:
                d = seq.draft_rank
                if d_plans[d] is None:
                    d_plans[d] = StepPlan(step_id=sid, width=width)
                # The slots reserved: with a pre-draft's where they fit (_reserve).
                slots = self._draft_slots.pop(seq.seq_id, seq.step_len + proposal_len - 1)
                _add_seq(d_plans[d], seq, seq.draft_computed, slots, proposal_len)
                d_seqs[d].append(seq)
        for plan in t_plans:
            # Nobody asked: the plan says so with no entries, and the worker computes nothing.
            if plan is not None and all(x < 0 for x in plan.logprobs):
                plan.logprobs = []
        for plans, seqs in ((t_plans, t_seqs), (d_plans, d_seqs)):
            for plan, on in zip(plans, seqs):
                if plan is not None and any(s.params.structured_output is not None for s in on):
                    add_grammars(plan, on)
        # Pending frees ride with a plan of that worker, or alone when it has no work.
        for plans, frees in ((t_plans, self._target_frees), (d_plans, self._draft_frees)):
            for r, pending in enumerate(frees):
                if not pending:
                    continue
                if plans[r] is None:
                    plans[r] = StepPlan(step_id=sid, width=width)
                plans[r].free_seq_ids = pending
                frees[r] = []
        return ScheduledStep(sid, [s for s, _ in batch], t_plans, t_seqs, d_plans, d_seqs)

    def draft_lost(self, rank: int) -> None:
        """A draft worker died (or came back empty): its sequences decode on the target
        alone until ``draft_back``; whatever it cached is gone (computed = 0 there)."""
        self.drafts_down.add(rank)
        self.stats.num_draft_worker_failures += 1
        if self.draft_pools:
            self.draft_pools[rank].reset()
        self._draft_frees[rank] = []
        for seq in self.running:
            if seq.draft_rank == rank:
                seq.draft_computed = 0

    def draft_back(self, rank: int) -> None:
        """The draft worker runs again, empty: its sequences catch up from scratch."""
        self.drafts_down.discard(rank)

    def target_lost(self, rank: int) -> None:
        """A target worker died: its sequences go back to the queue with every token they
        emitted (recomputed later, on it once restarted or on another target worker)."""
        self.targets_down.add(rank)
        self.stats.num_target_worker_failures += 1
        for seq in [s for s in self.running if s.target_rank == rank]:
            self._preempt(seq)
        self.target_pools[rank].reset()
        self._target_frees[rank] = []

    def target_back(self, rank: int) -> None:
        self.targets_down.discard(rank)

    def step_failed(self, step: ScheduledStep, lost_drafts=(), lost_targets=()) -> Sequence | None:
        """A step that raised: nothing of it is kept. Its sequences go back to the queue
        with every token they had (their KV is recomputed, as after a preemption: exact);
        the frees its plans carried are told again (a worker ignores frees of sequences it
        does not hold; not those of sequences running again since, whose KV the worker now
        holds anew); the workers lost on the way are dealt with as in ``update``; and the
        sequences become suspects. Returns the culprit when the step ran one sequence: it is
        finished with reason "error" (the caller fails its request)."""
        running = {s.seq_id for s in self.running}
        for plans, frees, down in ((step.target_plans, self._target_frees, self.targets_down),
                                   (step.draft_plans, self._draft_frees, self.drafts_down)):
            for r, plan in enumerate(plans):
                if plan is not None and r not in down:
                    frees[r][:0] = [sid for sid in plan.free_seq_ids if sid not in running]
        seqs = [s for s in step.seqs if not s.finished]
        for seq in seqs:
            if seq.status is SequenceStatus.RUNNING:
                self._preempt(seq, counted=False)
        for r in sorted(lost_drafts):
            self.draft_lost(r)
        for r in sorted(lost_targets):
            self.target_lost(r)
        culprit = self.quarantine.failed([s.seq_id for s in seqs])
        if culprit is None:
            return None
        seq = next(s for s in seqs if s.seq_id == culprit)
        self.finish(seq, "error")
        return seq

    # -- results -------------------------------------------------------------------
    def update(self, outcome: StepOutcome) -> list[tuple[Sequence, list[int]]]:
        """Apply a step's outcome: every verdict (``Sequence.apply``), then the lost
        workers; the stats and the policy read the same outcome. Returns (sequence, tokens
        appended) per verdict. Finished sequences are released."""
        self._check_outcome(outcome)
        in_step = {s.seq_id: s for s in outcome.step.seqs}
        out = []
        for v in outcome.verdicts:
            seq = in_step.pop(v.seq_id)
            if seq.status is not SequenceStatus.RUNNING:
                # Aborted, or preempted by a lost worker, while this step was in flight
                # (groups in flight): what it emitted is recomputed, or not wanted.
                continue
            out.append((seq, seq.apply(v, self.max_model_len, outcome.draft_kept.get(v.seq_id))))
            if seq.draft_rank in self.drafts_down:
                seq.draft_computed = 0     # lost since this step was planned: it holds nothing
        for r in sorted(outcome.lost_drafts):
            self.draft_lost(r)
        for r in sorted(outcome.lost_targets):
            self.target_lost(r)
        self.stats.record(outcome)
        if self.num_speculative_tokens:
            self.policy.observe(outcome)
        for seq, _ in out:
            if seq.finished:
                self.running.remove(seq)
                self._release(seq)
                self.stats.num_requests_finished += 1
        self.quarantine.passed(v.seq_id for v in outcome.verdicts)
        return out

    def _check_outcome(self, outcome: StepOutcome) -> None:
        """What ``update`` would refuse, before it changes anything (a refused outcome is
        a failed step, requeued whole): one verdict per sequence of the step, with
        logprobs where it keeps them, and one for every sequence still running but those
        on a target worker lost in the step (they are preempted)."""
        in_step = {s.seq_id: s for s in outcome.step.seqs}
        seen = set()
        for v in outcome.verdicts:
            seq = in_step.get(v.seq_id)
            if seq is None or v.seq_id in seen:
                raise ValueError(f"a verdict for sequence {v.seq_id}, which is not in step {outcome.step.step_id} "
                                 "(or has two)")
            seen.add(v.seq_id)
            if seq.status is SequenceStatus.RUNNING and (seq.logprobs is None) != (v.logprobs is None):
                raise ValueError(f"sequence {seq.seq_id} keeps logprobs: {seq.logprobs is not None}, "
                                 f"its verdict carries them: {v.logprobs is not None}")
        missing = [sid for sid, s in in_step.items() if sid not in seen and s.status is SequenceStatus.RUNNING
                   and s.target_rank not in outcome.lost_targets]
        if missing:
            raise ValueError(f"step {outcome.step.step_id} has no verdict for sequences {missing}")

    def finish(self, seq: Sequence, reason: str) -> None:
        """End one unfinished sequence between steps (a client's abort, a stop string):
        its blocks are freed now and the workers told with the next plans."""
        if seq.finished:
            return
        if seq in self.running:
            self.running.remove(seq)
            self._release(seq)
        else:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def abort_all(self, reason: str) -> list[Sequence]:
        """Fail every unfinished sequence (used when no worker can serve them)."""
        seqs = list(self.running) + list(self.waiting)
        for seq in list(self.running):
            self.running.remove(seq)
            self._release(seq)
        self.waiting.clear()
        for seq in seqs:
            seq.status = SequenceStatus.FINISHED
            seq.finish_reason = reason
        return seqs

    def check_integrity(self) -> None:
        for pool in self.target_pools + self.draft_pools:
            pool.check_integrity()
        ids = [s.seq_id for s in self.running] + [s.seq_id for s in self.waiting]
        assert len(ids) == len(set(ids)), "a sequence is both waiting and running"
        for s in self.waiting:
            assert not any(p.has(s.seq_id) for p in self.target_pools), \
                f"waiting sequence {s.seq_id} holds target blocks"


def _as_list(pools) -> list[BlockManager]:
    return list(pools) if isinstance(pools, (list, tuple)) else [pools]


def _add_seq(plan: StepPlan, seq: Sequence, computed: int, slots: int, proposal_len: int) -> None:
    p = seq.params
    plan.seq_ids.append(seq.seq_id)
    plan.num_computed.append(computed)
    plan.num_new.append(seq.num_tokens - computed)
    plan.token_ids.extend(seq.tokens[computed:])
    plan.num_slots.append(slots)
    plan.proposal_lens.append(proposal_len)
    plan.temperature.append(p.temperature)
    plan.top_k.append(p.top_k)
    plan.top_p.append(p.top_p)
    plan.seeds.append(seq.seed)
