"""Continuous batching with per-sequence proposal lengths and lookahead reservation,
over any number of target and draft workers.

Each step::

    schedule()  -> ScheduledStep: one plan per target worker, one per draft worker
    workers     -> Proposals (per draft worker), StepResult (per target worker)
    update()    -> sequences advanced, finished ones released

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
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from specray.scheduler.block_manager import BlockManager
from specray.scheduler.merge import MergedProposals
from specray.scheduler.messages import StepPlan, StepResult
from specray.scheduler.sequence import Sequence, SequenceStatus
from specray.scheduler.speculation_policy import SpeculationPolicy
from specray.scheduler.stats import SpecStats


@dataclass
class SchedulerConfig:
    num_speculative_tokens: int
    target_max_len: int
    draft_max_len: int | None = None     # None: the proposer has no length limit (n-gram)
    use_proposer: bool = True            # False: proposer "none", plain decoding
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192   # prefill budget per step for newly admitted work
    speculation_policy: str = "static"   # "static" | "adaptive" (goodput-based, per sequence)
    disable_by_batch_size: int | None = None
    draft_early_stop: bool = True        # adaptive, batch 1: the draft stops where a proposal stops paying
    max_speculative_tokens: int | None = None   # adaptive with early stops: a sequence alone's cap

    def __post_init__(self) -> None:
        if self.num_speculative_tokens < 0:
            raise ValueError(f"num_speculative_tokens must be >= 0, got {self.num_speculative_tokens}")
        if self.target_max_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.target_max_len}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")


@dataclass
class ScheduledStep:
    step_id: int
    seqs: list[Sequence]                          # every scheduled sequence, oldest first
    target_plans: list[StepPlan | None]           # per target worker; None: nothing to send
    target_seqs: list[list[Sequence]]
    draft_plans: list[StepPlan | None] = field(default_factory=list)   # per draft worker
    draft_seqs: list[list[Sequence]] = field(default_factory=list)
    lost_drafts: set[int] = field(default_factory=set)                # draft workers that failed this step
    lost_targets: set[int] = field(default_factory=set)               # target workers that failed this step
    call_s: float = 0.0                                               # draft + verify calls' wall time
    # seq id -> the draft's probability of each of its proposals (drafts that stop early)
    draft_confidence: dict[int, list[float]] = field(default_factory=dict)


class Scheduler:
    def __init__(self, config: SchedulerConfig, target_pools: BlockManager | list[BlockManager],
                 draft_pools: BlockManager | list[BlockManager] | None = None, num_proposers: int = 1) -> None:
        """``draft_pools``: the draft workers' pools (None for a proposer without KV, such
        as n-gram lookup, of which there are ``num_proposers``)."""
        self.config = config
        self.policy = SpeculationPolicy(config.speculation_policy, config.num_speculative_tokens,
                                        config.disable_by_batch_size, stop_early=config.draft_early_stop,
                                        alone_k_max=config.max_speculative_tokens)
        # The widest step: lookahead slots are reserved and caps computed for it; the
        # policy keeps a batch within num_speculative_tokens.
        self.k = self.policy.widest_k if config.use_proposer else 0
        self.target_pools = _as_list(target_pools)
        self.draft_pools = _as_list(draft_pools) if draft_pools is not None else []
        if not self.target_pools:
            raise ValueError("at least one target pool is needed")
        self.num_draft_ranks = (len(self.draft_pools) or num_proposers) if self.k else 0
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.stats = SpecStats(k=self.k)
        self._step_id = 0
        # Frees the workers have not been told about yet; they travel with the next plan.
        self._target_frees: list[list[int]] = [[] for _ in self.target_pools]
        self._draft_frees: list[list[int]] = [[] for _ in range(self.num_draft_ranks)]
        self.drafts_down: set[int] = set()   # draft workers lost and not back yet
        self.targets_down: set[int] = set()  # target workers lost and not back yet

    # -- requests ------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        if seq.num_tokens >= self.config.target_max_len:
            raise ValueError(f"prompt of {seq.num_tokens} tokens leaves no room below max_model_len "
                             f"{self.config.target_max_len}")
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- planning ------------------------------------------------------------------
    def proposal_len(self, seq: Sequence) -> int:
        """k_i: at most k, leaves room for the bonus token inside max_tokens and
        max_model_len, and is 0 where the draft cannot see that far."""
        if self.k == 0 or seq.draft_rank in self.drafts_down:
            return 0
        n = seq.num_tokens
        k = min(self.k, seq.remaining - 1, self.config.target_max_len - n - 1)
        limit = self.config.draft_max_len
        if limit is not None and n + k > limit:
            # The seed's split: past the draft's window the sequence decodes without it.
            return 0
        return max(k, 0)

    def _draft_pool(self, seq: Sequence) -> BlockManager | None:
        return self.draft_pools[seq.draft_rank] if self.draft_pools else None

    def _reserve(self, seq: Sequence, k: int) -> int | None:
        """Reserve slots for one step; returns the k_i that fits (draft shortfalls lower
        it to 0, which needs no draft slots) or None when the target cannot hold even the
        fed tokens."""
        n = seq.num_tokens
        target = self.target_pools[seq.target_rank]
        draft = self._draft_pool(seq)
        if k > 0 and draft is not None and not _fits(draft, seq.seq_id, n + k - 1):
            k = 0
        if not _fits(target, seq.seq_id, n + k):
            if k == 0 or not _fits(target, seq.seq_id, n):
                return None
            k = 0
        _resize(target, seq.seq_id, n + k)
        if k > 0 and draft is not None:
            _resize(draft, seq.seq_id, n + k - 1)
        return k

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._release(seq)
        seq.reset_computed()
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.stats.num_preemptions += 1
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
            r in self.targets_down, not _fits(self.target_pools[r], seq.seq_id, n), t_load[r], r))
        seq.draft_rank = min(range(len(d_load)), key=lambda r: (r in self.drafts_down, d_load[r], r))
        t_load[seq.target_rank] += n
        d_load[seq.draft_rank] += n

    def _planned_k(self) -> tuple[dict[int, int], int]:
        """The policy's k_i for every running sequence, and the k a newcomer gets."""
        caps = [self.proposal_len(s) for s in self.running]
        if self.k == 0:
            return {s.seq_id: 0 for s in self.running}, 0
        fed = sum(s.num_tokens - s.target_computed for s in self.running)
        ks = self.policy.choose(caps, [s.acceptance for s in self.running], fed)
        planned = {s.seq_id: k for s, k in zip(self.running, ks)}
        if self.policy.kind == "static":
            newcomer = self.policy.k_max
        elif ks:
            # Within k_max: a sequence alone may plan further, but a newcomer makes a batch.
            newcomer = min(round(sum(ks) / len(ks)), self.policy.k_max)
        else:
            # Nothing running to go by: what the model would give a fresh sequence. Not k
            # regardless: with a draft that has been failing, every newcomer would cost the
            # draft a prefill for proposals that will be rejected.
            newcomer = self.policy.fresh_k(self.k, self._reachable_batch())
        # The rule holds for the batch this step may reach, not the one before admissions:
        # requests arriving together into an empty batch would otherwise all propose (and
        # the draft prefill every prompt) in the very step the rule exists to spare.
        limit = self.policy.disable_by_batch_size
        if limit is not None and self._reachable_batch() >= limit:
            newcomer = 0
        return planned, newcomer

    def _reachable_batch(self) -> int:
        """The batch this step may reach once the waiting requests are admitted."""
        return min(len(self.running) + len(self.waiting), self.config.max_num_seqs)

    def schedule(self) -> ScheduledStep | None:
        batch: list[tuple[Sequence, int]] = []
        preempted = False
        planned, newcomer_k = self._planned_k()
        queue = list(self.running)
        while queue:
            seq = queue.pop(0)
            k = self._reserve(seq, planned[seq.seq_id])
            while k is None:
                same_pool = [s for s in queue if s.target_rank == seq.target_rank]
                victim = same_pool[-1] if same_pool else seq
                if victim is not seq:
                    queue.remove(victim)
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
                k = self._reserve(seq, planned[seq.seq_id])
            if k is not None:
                batch.append((seq, k))

        budget = self.config.max_num_batched_tokens - sum(s.num_tokens - s.target_computed for s, _ in batch)
        t_load = [0] * len(self.target_pools)
        d_load = [0] * max(self.num_draft_ranks, 1)
        for s in self.running:
            t_load[s.target_rank] += s.num_tokens
            d_load[s.draft_rank] += s.num_tokens
        # No admissions in a step that had to preempt (that would thrash), unless nothing
        # runs at all: then a sequence that outgrew its pool is placed again, maybe elsewhere.
        while self.waiting and not (preempted and batch) and len(batch) < self.config.max_num_seqs:
            seq = self.waiting[0]
            cost = seq.num_tokens - seq.target_computed
            if batch and cost > budget:
                break
            self._place(seq, t_load, d_load)
            if seq.target_rank in self.targets_down:
                break   # every target worker is down: wait for one to come back
            k = self._reserve(seq, min(self.proposal_len(seq), newcomer_k))
            if k is None:
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.append((seq, k))
            budget -= cost

        if not batch:
            if self.waiting and not self.running and len(self.targets_down) < len(self.target_pools):
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
        # Every plan of a step shares one k (proposals and draft probabilities are [n, k]
        # grids): the longest proposal this step, not the configured k. A step where
        # nobody proposes then scores one row per sequence, as plain decoding does,
        # instead of k + 1.
        k_step = max((k for _, k in batch), default=0)
        for seq, k in batch:
            seq.step_len = n = seq.num_tokens
            seq.step_k = k
            t = seq.target_rank
            if t_plans[t] is None:
                t_plans[t] = StepPlan(step_id=sid, k=k_step)
            _add_seq(t_plans[t], seq, seq.target_computed, n + k, k)
            t_seqs[t].append(seq)
            if k:
                d = seq.draft_rank
                if d_plans[d] is None:
                    d_plans[d] = StepPlan(step_id=sid, k=k_step)
                _add_seq(d_plans[d], seq, seq.draft_computed, n + k - 1, k)
                d_seqs[d].append(seq)
        if self.policy.stopping and any(d_plans):
            # Floors under which a draft stops proposing early (see SpeculationPolicy).
            floors = {s.seq_id: self.policy.min_reach(s.acceptance) for s, k in batch if k > 1}
            if any(floors.values()):
                reach_map = self.policy.reach_map()
                for plan in d_plans:
                    if plan is not None:
                        plan.min_reach = [floors.get(sid, 0.0) for sid in plan.seq_ids]
                        plan.reach_map = list(reach_map)
        # Pending frees ride with a plan of that worker, or alone when it has no work.
        for plans, frees in ((t_plans, self._target_frees), (d_plans, self._draft_frees)):
            for r, pending in enumerate(frees):
                if not pending:
                    continue
                if plans[r] is None:
                    plans[r] = StepPlan(step_id=sid, k=k_step)
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

    def attach_proposals(self, step: ScheduledStep, rank: int, merged: MergedProposals) -> None:
        plan = step.target_plans[rank]
        plan.proposal_token_ids = merged.token_ids
        plan.proposal_lens = merged.proposal_lens
        plan.draft_rows = merged.draft_rows
        if merged.confidence:
            step.draft_confidence.update(merged.confidence)

    def observe_times(self, step: ScheduledStep, draft_s: float | None, verify_s: float) -> None:
        """Feed measured call times to the policy's cost model (only an adaptive policy
        uses one)."""
        step.call_s = (draft_s or 0.0) + verify_s
        if self.policy.kind != "adaptive":
            return
        plans = [p for p in step.target_plans if p is not None and p.seq_ids]
        fed = sum(sum(p.num_new) for p in plans)
        proposed = sum(sum(p.proposal_lens) for p in plans)
        longest = max((max(p.proposal_lens, default=0) for p in plans), default=0)
        self.policy.cost.observe_target(len(step.seqs), fed, proposed, longest, verify_s)
        if draft_s is not None:
            dplans = [p for p in step.draft_plans if p is not None and p.seq_ids]
            # The target plans hold the proposals merged into them, so ``longest`` and
            # ``proposed`` are the passes and tokens the drafts made: fewer than chosen
            # where one stopped early.
            fed_draft = sum(sum(p.num_new) for p in dplans)
            self.policy.cost.observe_draft(len(step.seqs), longest, fed_draft, proposed, draft_s)

    # -- results -------------------------------------------------------------------
    def update(self, step: ScheduledStep, results: list[StepResult | None], seconds: float = 0.0
               ) -> list[tuple[Sequence, list[int]]]:
        """Apply every target worker's verdict (``results`` aligned with
        ``step.target_plans``); return (sequence, newly appended tokens) for every
        sequence of the step. Finished sequences are released."""
        for r, (plan, seqs) in enumerate(zip(step.target_plans, step.target_seqs)):
            if r in step.lost_targets:
                continue
            res = results[r] if r < len(results) else None
            if seqs and (res is None or list(res.seq_ids) != [s.seq_id for s in seqs]
                         or len(res.num_emitted) != len(seqs) or sum(res.num_emitted) != len(res.token_ids)):
                raise ValueError(f"StepResult of target worker {r} does not match its batch")
            if seqs:
                for i, (seq, n_emit) in enumerate(zip(seqs, res.num_emitted)):
                    proposed = plan.proposal_lens[i] if plan.proposal_token_ids else 0
                    if not 1 <= n_emit <= proposed + 1:
                        raise ValueError(f"sequence {seq.seq_id} emitted {n_emit} tokens for {proposed} proposals")
        out = []
        drafted = accepted = emitted_total = longest = 0
        for r, (plan, seqs) in enumerate(zip(step.target_plans, step.target_seqs)):
            if not seqs or r in step.lost_targets:
                continue
            res = results[r]
            pos = 0
            for i, seq in enumerate(seqs):
                n_emit = res.num_emitted[i]
                emitted = res.token_ids[pos:pos + n_emit]
                pos += n_emit
                proposed = plan.proposal_lens[i] if plan.proposal_token_ids else 0
                n_acc = n_emit - 1
                L = seq.step_len
                seq.target_computed = L + n_acc
                if seq.draft_rank in step.lost_drafts:
                    seq.draft_computed = 0
                elif seq.step_k:
                    # The draft cached its fed tokens and all its proposals but the last.
                    seq.draft_computed = L + min(n_acc, max(proposed - 1, 0))
                seq.num_draft_tokens += proposed
                seq.num_accepted_tokens += n_acc
                if self.k:
                    self.policy.observe(seq.acceptance, proposed, n_acc, step.draft_confidence.get(seq.seq_id))
                    self.stats.record_positions(proposed, n_acc)
                drafted += proposed
                longest = max(longest, proposed)
                if seq.seq_id in step.draft_confidence:
                    self.stats.num_stopped_proposals += seq.step_k - proposed
                accepted += n_acc
                emitted_total += n_emit
                out.append((seq, self._append(seq, emitted)))
        self.stats.record_step(len(out), emitted_total, drafted, accepted, seconds)
        if self.policy.kind == "adaptive":
            fed = sum(sum(p.num_new) for p in step.target_plans if p is not None)
            # Beyond the one token per drafting sequence that the step's price assumes.
            catch_up = sum(sum(p.num_new) - len(p.seq_ids) for p in step.draft_plans if p is not None)
            self.policy.observe_step(len(out), fed, drafted, emitted_total, seconds, catch_up, longest)
            self.policy.cost.observe_overhead(len(out), seconds - step.call_s)
        self.stats.record_speculation(sum(s.step_k for s, _ in out), len(out), self.k)
        for seq, _ in out:
            if seq.finished:
                self.running.remove(seq)
                self._release(seq)
                self.stats.num_requests_finished += 1
        return out

    def _append(self, seq: Sequence, emitted: list[int]) -> list[int]:
        appended = []
        for t in emitted:
            seq.tokens.append(t)
            appended.append(t)
            if t in seq.stop_ids:
                seq.finish_reason = "stop"
            elif seq.output_len >= seq.params.max_tokens or seq.num_tokens >= self.config.target_max_len:
                seq.finish_reason = "length"
            if seq.finish_reason:
                seq.status = SequenceStatus.FINISHED
                break
        return appended

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


def _fits(bm: BlockManager, seq_id: int, slots: int) -> bool:
    # Shrinking always fits; growth needs the missing blocks free.
    return bm.blocks_needed(slots) - len(bm.block_table(seq_id)) <= bm.num_free_blocks


def _resize(bm: BlockManager, seq_id: int, slots: int) -> None:
    bm.truncate(seq_id, slots)
    if not bm.allocate(seq_id, slots):
        raise AssertionError("allocation failed after a fit check")


def _add_seq(plan: StepPlan, seq: Sequence, computed: int, slots: int, k: int) -> None:
    p = seq.params
    plan.seq_ids.append(seq.seq_id)
    plan.num_computed.append(computed)
    plan.num_new.append(seq.num_tokens - computed)
    plan.token_ids.extend(seq.tokens[computed:])
    plan.num_slots.append(slots)
    plan.proposal_lens.append(k)
    plan.temperature.append(p.temperature)
    plan.top_k.append(p.top_k)
    plan.top_p.append(p.top_p)
    plan.seeds.append(seq.seed)
