"""Continuous batching with per-sequence proposal lengths and lookahead reservation.

Each step::

    schedule()  -> ScheduledStep (a target plan, and a draft plan for sequences with k_i > 0)
    workers     -> Proposals, StepResult
    update()    -> sequences advanced, finished ones released

Running sequences are served oldest first and keep their place; when a worker's pool
cannot hold a sequence's slots the newest running sequence is preempted (its KV is
dropped everywhere and it is recomputed from its tokens later: ``computed = 0``). Waiting
requests join only with what is left. Nothing is ever dropped: a preempted sequence goes
back to the front of the queue with every token it had emitted.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from scheduler.block_manager import BlockManager
from scheduler.merge import MergedProposals
from scheduler.messages import StepPlan, StepResult
from scheduler.sequence import Sequence, SequenceStatus
from scheduler.stats import SpecStats


@dataclass
class SchedulerConfig:
    num_speculative_tokens: int
    target_max_len: int
    draft_max_len: int | None = None     # None: the proposer has no length limit (n-gram)
    use_proposer: bool = True            # False: proposer "none", plain decoding
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192   # prefill budget per step for newly admitted work

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
    seqs: list[Sequence]                 # the target batch, in order
    target: StepPlan
    draft: StepPlan | None               # sequences with k_i > 0, same relative order
    draft_seqs: list[Sequence] = field(default_factory=list)


class Scheduler:
    def __init__(self, config: SchedulerConfig, target_blocks: BlockManager,
                 draft_blocks: BlockManager | None = None) -> None:
        self.config = config
        self.k = config.num_speculative_tokens if config.use_proposer else 0
        self.target_blocks = target_blocks
        self.draft_blocks = draft_blocks
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.stats = SpecStats(k=self.k)
        self._step_id = 0
        # Frees the workers have not been told about yet; they travel with the next plan.
        self._target_frees: list[int] = []
        self._draft_frees: list[int] = []

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

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    # -- planning ------------------------------------------------------------------
    def proposal_len(self, seq: Sequence) -> int:
        """k_i: at most k, leaves room for the bonus token inside max_tokens and
        max_model_len, and is 0 where the draft cannot see that far."""
        if self.k == 0:
            return 0
        n = seq.num_tokens
        k = min(self.k, seq.remaining - 1, self.config.target_max_len - n - 1)
        limit = self.config.draft_max_len
        if limit is not None and n + k > limit:
            # The seed's split: past the draft's window the sequence decodes without it.
            return 0
        return max(k, 0)

    def _reserve(self, seq: Sequence, k: int) -> int | None:
        """Reserve slots for one step; returns the k_i that fits (draft shortfalls lower
        it to 0, which needs no draft slots) or None when the target cannot hold even the
        fed tokens."""
        n = seq.num_tokens
        draft = self.draft_blocks
        if k > 0 and draft is not None and not _fits(draft, seq.seq_id, n + k - 1):
            k = 0
        if not _fits(self.target_blocks, seq.seq_id, n + k):
            if k == 0 or not _fits(self.target_blocks, seq.seq_id, n):
                return None
            k = 0
        _resize(self.target_blocks, seq.seq_id, n + k)
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
        # Oldest first among waiting, so a preempted sequence keeps its priority.
        self.waiting.appendleft(seq)

    def _release(self, seq: Sequence) -> None:
        # Workers ignore frees of sequences they never saw, so telling both is always safe.
        self.target_blocks.free(seq.seq_id)
        self._target_frees.append(seq.seq_id)
        if self.draft_blocks is not None:
            self.draft_blocks.free(seq.seq_id)
        if self.k:
            self._draft_frees.append(seq.seq_id)

    def schedule(self) -> ScheduledStep | None:
        batch: list[tuple[Sequence, int]] = []
        preempted = False
        queue = list(self.running)
        while queue:
            seq = queue.pop(0)
            k = self._reserve(seq, self.proposal_len(seq))
            while k is None:
                victim = queue.pop() if queue else seq
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
                k = self._reserve(seq, self.proposal_len(seq))
            if k is not None:
                batch.append((seq, k))

        budget = self.config.max_num_batched_tokens - sum(s.num_tokens - s.target_computed for s, _ in batch)
        while self.waiting and not preempted and len(batch) < self.config.max_num_seqs:
            seq = self.waiting[0]
            cost = seq.num_tokens - seq.target_computed
            if batch and cost > budget:
                break
            k = self._reserve(seq, self.proposal_len(seq))
            if k is None:
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.append((seq, k))
            budget -= cost

        if not batch:
            if self.waiting and not self.running:
                seq = self.waiting[0]
                raise RuntimeError(f"KV pool too small: request {seq.request_id} needs "
                                   f"{self.target_blocks.blocks_needed(seq.num_tokens)} blocks, the pool has "
                                   f"{self.target_blocks.num_blocks}")
            return None
        return self._build(batch)

    def _build(self, batch: list[tuple[Sequence, int]]) -> ScheduledStep:
        self._step_id += 1
        target = StepPlan(step_id=self._step_id, k=self.k, free_seq_ids=self._target_frees)
        self._target_frees = []
        draft = None
        draft_seqs: list[Sequence] = []
        if any(k for _, k in batch) or (self._draft_frees and self.k):
            draft = StepPlan(step_id=self._step_id, k=self.k, free_seq_ids=self._draft_frees)
            self._draft_frees = []
        for seq, k in batch:
            seq.step_len = n = seq.num_tokens
            seq.step_k = k
            _add_seq(target, seq, seq.target_computed, n + k, k)
            if k:
                _add_seq(draft, seq, seq.draft_computed, n + k - 1, k)
                draft_seqs.append(seq)
        return ScheduledStep(self._step_id, [s for s, _ in batch], target, draft, draft_seqs)

    def attach_proposals(self, step: ScheduledStep, merged: MergedProposals) -> None:
        step.target.proposal_token_ids = merged.token_ids
        step.target.proposal_lens = merged.proposal_lens
        step.target.draft_rows = merged.draft_rows

    # -- results -------------------------------------------------------------------
    def update(self, step: ScheduledStep, result: StepResult, seconds: float = 0.0) -> list[tuple[Sequence, list[int]]]:
        """Apply the target's verdict; return (sequence, newly appended tokens) for every
        sequence of the step. Finished sequences are released."""
        if list(result.seq_ids) != [s.seq_id for s in step.seqs]:
            raise ValueError("StepResult does not match the scheduled batch")
        out = []
        plan = step.target
        drafted = accepted = emitted_total = 0
        pos = 0
        in_draft = {s.seq_id for s in step.draft_seqs}
        for i, seq in enumerate(step.seqs):
            n_emit = result.num_emitted[i]
            emitted = result.token_ids[pos:pos + n_emit]
            pos += n_emit
            proposed = plan.proposal_lens[i] if plan.proposal_lens else 0
            n_acc = n_emit - 1
            if n_acc > proposed:
                raise ValueError(f"sequence {seq.seq_id} accepted {n_acc} of {proposed} proposals")
            L = seq.step_len
            seq.target_computed = L + n_acc
            if seq.seq_id in in_draft:
                seq.draft_computed = L + min(n_acc, max(proposed - 1, 0))
            seq.num_draft_tokens += proposed
            seq.num_accepted_tokens += n_acc
            drafted += proposed
            accepted += n_acc
            emitted_total += n_emit
            appended = self._append(seq, emitted)
            out.append((seq, appended))
        self.stats.record_step(len(step.seqs), emitted_total, drafted, accepted, seconds)
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
        self.target_blocks.check_integrity()
        if self.draft_blocks is not None:
            self.draft_blocks.check_integrity()
        ids = [s.seq_id for s in self.running] + [s.seq_id for s in self.waiting]
        assert len(ids) == len(set(ids)), "a sequence is both waiting and running"
        for s in self.waiting:
            assert not self.target_blocks.has(s.seq_id), f"waiting sequence {s.seq_id} holds target blocks"


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
