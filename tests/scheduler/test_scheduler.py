"""Scheduler, driven by a pure-Python stand-in for N target and M draft workers.

The "model" is a deterministic function of the token history; the draft proposes the same
function but is wrong at positions chosen by ``draft_wrong``. Each fake worker (one per
target rank and one per draft rank) keeps what a real worker keeps -- per sequence, the
tokens in its KV cache and a BlockManager resized the way ``workers/kv_cache.py`` resizes
it -- and asserts the ``num_computed`` invariant on every plan: ``num_computed`` is exactly
the length of the cached prefix that matches the sequence's true tokens (nothing stale is
trusted, nothing valid is recomputed), and the fed tokens complete it to exactly the
sequence's current length.

On every step the engine also checks what the driver promises the workers: each sequence
sits on one target and one draft rank and keeps them while it runs; each rank's plan holds
exactly its own sequences and exactly the frees of the sequences it held that finished or
were preempted since its last plan (a plan may carry only frees); preemption on a target
rank takes the newest sequences of that rank; and once the workers applied their plans
every rank's pool equals the driver's mirror of it.

Workers can also die (``kill_draft`` / ``kill_target``), between steps or during their call
the way ``runtime/engine.py`` reports it, and a killed fake worker comes back holding nothing:
any plan that still trusts what it held fails the ``num_computed`` check above.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Callable

import pytest

from specray.scheduler.acceptance import AcceptanceEstimate
from specray.scheduler.block_manager import BlockManager
from specray.scheduler.merge import merge_proposals
from specray.scheduler.messages import Proposals, StepPlan, StepResult, decode, encode
from specray.scheduler.sampling_params import SamplingParams
from specray.scheduler.scheduler import ScheduledStep, Scheduler, SchedulerConfig
from specray.scheduler.sequence import Sequence, SequenceStatus
from specray_testing import FixedFloorPolicy

V = 97


def true_next(tokens: list[int]) -> int:
    return (31 * tokens[-1] + 7 * len(tokens)) % V


def default_wrong(seq_id: int, pos: int) -> bool:
    return (3 * seq_id + 5 * pos) % 7 in (0, 3)


def reference(prompt: list[int], max_tokens: int, stop_ids=(), max_len: int | None = None) -> tuple[list[int], str]:
    """What plain greedy decoding emits: the true next token, max_tokens times."""
    tokens = list(prompt)
    out: list[int] = []
    for _ in range(max_tokens):
        t = true_next(tokens)
        tokens.append(t)
        out.append(t)
        if t in stop_ids:
            return out, "stop"
        if max_len is not None and len(tokens) >= max_len:
            return out, "length"
    return out, "length"


def make_seq(seq_id: int, prompt: list[int], max_tokens: int, stop_ids=()) -> Sequence:
    return Sequence(seq_id=seq_id, request_id=f"req-{seq_id}", prompt_len=len(prompt), tokens=list(prompt),
                    params=SamplingParams(max_tokens=max_tokens, temperature=0.0), seed=seq_id,
                    stop_ids=frozenset(stop_ids))


def prompt_for(seq_id: int, length: int) -> list[int]:
    return [(seq_id * 13 + 5 * j + 1) % V for j in range(length)]


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def roundtrip(plan: StepPlan) -> StepPlan:
    """What a worker receives: the plan after the wire (validates it, too)."""
    return decode(encode(plan), expected=StepPlan)


class FakeWorker:
    def __init__(self, name: str, num_blocks: int, block_size: int) -> None:
        self.name = name
        self.cache: dict[int, list[int]] = {}
        self.blocks = BlockManager(num_blocks, block_size)
        self.num_plans = 0          # plans received
        self.num_seq_plans = 0      # plans received that carried sequences

    def apply(self, plan: StepPlan, truth: dict[int, list[int]]) -> list[list[int]]:
        """Frees, then per sequence: check and truncate the cache to num_computed, feed the
        new tokens, resize the block mirror. Returns each sequence's history after feeding."""
        self.num_plans += 1
        self.num_seq_plans += bool(plan.seq_ids)
        for sid in plan.free_seq_ids:
            self.cache.pop(sid, None)
            self.blocks.free(sid)
        histories = []
        pos = 0
        for i, sid in enumerate(plan.seq_ids):
            c, m, slots = plan.num_computed[i], plan.num_new[i], plan.num_slots[i]
            assert sid in truth, f"{self.name}: seq {sid} is not part of this step"
            cache = self.cache.setdefault(sid, [])
            assert c <= len(cache), f"{self.name}: seq {sid} computed {c} > cached {len(cache)}"
            assert cache[:c] == truth[sid][:c], f"{self.name}: seq {sid} cached prefix is stale"
            # ... and nothing the worker already holds correctly is fed again
            assert c == common_prefix(cache, truth[sid]), f"{self.name}: seq {sid} re-fed cached tokens"
            del cache[c:]
            cache.extend(plan.token_ids[pos:pos + m])
            pos += m
            assert cache == truth[sid], f"{self.name}: seq {sid} fed tokens do not complete its history"
            assert c <= self.blocks.num_slots(sid), f"{self.name}: seq {sid} has fewer slots than computed"
            self.blocks.truncate(sid, slots)
            assert self.blocks.allocate(sid, slots), f"{self.name}: worker pool out of blocks"
            histories.append(list(cache))
        self.blocks.check_integrity()
        return histories


@dataclass
class Counts:
    seq_steps: int = 0
    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    emitted: int = 0
    draft_calls: int = 0


@dataclass
class Preemption:
    step_id: int
    seq_id: int
    target_rank: int
    # running sequences of other target ranks that were newer than the victim (and kept running)
    newer_elsewhere: list[int]


@dataclass
class Engine:
    """schedule -> draft (every draft rank) -> merge -> verify (every target rank) -> update,
    with the fake workers."""
    sched: Scheduler
    targets: list[FakeWorker]
    drafts: list[FakeWorker]
    draft_wrong: Callable[[int, int], bool] = default_wrong
    num_shards: int = 2          # shards per draft rank
    probs: bool = False          # shards carry draft probabilities (draft_rows are then checked)
    # how many of its planned k_i tokens the proposer actually proposes (n-gram style)
    shorten: Callable[[int, int, int], int] | None = None
    counts: Counts = field(default_factory=Counts)
    finished: dict[int, Sequence] = field(default_factory=dict)
    outputs: dict[int, list[int]] = field(default_factory=dict)
    steps: list[ScheduledStep] = field(default_factory=list)     # kept when keep_steps
    results: list[list[StepResult | None]] = field(default_factory=list)
    on_step: Callable[[ScheduledStep], None] | None = None
    on_plan: Callable[[ScheduledStep], None] | None = None
    keep_steps: bool = False
    # admissions into ample pools go to the least loaded rank by tokens, exactly
    check_balance: bool = False
    # bookkeeping of the checks
    ranks: dict[int, tuple[int, int]] = field(default_factory=dict)       # seq -> (target, draft) while running
    placements: list[tuple[int, int, int]] = field(default_factory=list)  # (seq, target, draft) per admission
    preemptions: list[Preemption] = field(default_factory=list)
    _frees_t: list[set[int]] = field(default_factory=list)               # frees owed to each rank
    _frees_d: list[set[int]] = field(default_factory=list)
    # ranks whose call fails in the next step (the worker dies mid-step, as Engine.step sees it)
    fail_drafts: set[int] = field(default_factory=set)
    fail_targets: set[int] = field(default_factory=set)

    def __post_init__(self) -> None:
        assert len(self.targets) == len(self.sched.target_pools)
        self._frees_t = [set() for _ in self.sched.target_pools]
        self._frees_d = [set() for _ in range(self.sched.num_draft_ranks)]

    @property
    def target(self) -> FakeWorker:          # the single-rank tests' worker
        assert len(self.targets) == 1
        return self.targets[0]

    @property
    def draft(self) -> FakeWorker:
        assert len(self.drafts) == 1
        return self.drafts[0]

    def _owe(self, seq_id: int, t: int, d: int) -> None:
        """A released sequence's frees are owed to its ranks -- except to a rank that is down:
        it restarts empty, and a plan for it would be a call to a dead worker."""
        if t not in self.sched.targets_down:
            self._frees_t[t].add(seq_id)
        if self._frees_d and d not in self.sched.drafts_down:
            self._frees_d[d].add(seq_id)

    def kill_draft(self, d: int, step: ScheduledStep | None = None) -> None:
        """Draft worker ``d`` dies: between steps (``step`` None), or during ``step``'s call.
        It restarts empty, so any trust in what it held shows up as a stale prefix."""
        worker = self.drafts[d]
        self.drafts[d] = FakeWorker(worker.name, worker.blocks.num_blocks, worker.blocks.block_size)
        self._frees_d[d].clear()
        if step is not None:
            step.lost_drafts.add(d)
        self.sched.draft_lost(d)

    def kill_target(self, r: int, step: ScheduledStep | None = None) -> None:
        worker = self.targets[r]
        self.targets[r] = FakeWorker(worker.name, worker.blocks.num_blocks, worker.blocks.block_size)
        self._frees_t[r].clear()
        for s in self.sched.running:
            if s.target_rank == r:
                # requeued: its draft rank is owed a free, the dead target nothing
                del self.ranks[s.seq_id]
                if self._frees_d and s.draft_rank not in self.sched.drafts_down:
                    self._frees_d[s.draft_rank].add(s.seq_id)
        if step is not None:
            step.lost_targets.add(r)
        self.sched.target_lost(r)

    def truth(self, step: ScheduledStep) -> dict[int, list[int]]:
        return {s.seq_id: list(s.tokens) for s in step.seqs}

    def step(self) -> bool:
        sched = self.sched
        before_running = [(s, s.target_rank, s.draft_rank, s.num_preemptions) for s in sched.running]
        before_waiting = {s.seq_id for s in sched.waiting}
        step = sched.schedule()
        sched.check_integrity()
        if step is None:
            return False
        self.check_plan_shape(step, before_running, before_waiting)
        if self.on_plan is not None:
            self.on_plan(step)
        truth = self.truth(step)
        if any(p is not None for p in step.draft_plans):
            self.propose(step, truth)
        results = self.verify(step, truth)
        self.check_mirrors(step)
        out = sched.update(step, results)
        sched.check_integrity()
        assert [s for s, _ in out] == [s for r, seqs in enumerate(step.target_seqs)
                                       if r not in step.lost_targets for s in seqs]
        for seq, appended in out:
            self.outputs.setdefault(seq.seq_id, []).extend(appended)
            assert self.outputs[seq.seq_id] == seq.output_tokens
            if seq.finished:
                assert seq.seq_id not in self.finished, "a request finished twice"
                self.finished[seq.seq_id] = seq
                del self.ranks[seq.seq_id]
                # its workers are told with their next plan
                self._owe(seq.seq_id, seq.target_rank, seq.draft_rank)
            else:
                assert self.ranks[seq.seq_id] == (seq.target_rank, seq.draft_rank)
        if self.on_step is not None:
            self.on_step(step)
        if self.keep_steps:
            self.steps.append(step)
            self.results.append(results)
        return True

    def check_plan_shape(self, step: ScheduledStep, before_running: list[tuple[Sequence, int, int, int]],
                         before_waiting: set[int]) -> None:
        sched = self.sched
        T, D = len(sched.target_pools), sched.num_draft_ranks
        step_k = max((s.step_k for s in step.seqs), default=0)
        assert len(step.target_plans) == len(step.target_seqs) == T
        assert len(step.draft_plans) == len(step.draft_seqs) == D
        ids = [s.seq_id for s in step.seqs]
        assert len(ids) == len(set(ids))
        # a running sequence is kept (same place, same ranks) or preempted (its KV dropped
        # everywhere, its preemption counted); a preempted one may only come back as a newcomer
        preempted = [(s, t, d) for s, t, d, np in before_running if s.num_preemptions > np]
        for s, t, d, np in before_running:
            assert s.num_preemptions in (np, np + 1)
            assert s.num_preemptions > np or s in step.seqs, f"seq {s.seq_id} left the batch unpreempted"
        kept_ids = {s.seq_id for s, _, _, np in before_running if s.num_preemptions == np}
        kept = [s for s in step.seqs if s.seq_id in kept_ids]
        admitted = [s for s in step.seqs if s.seq_id not in kept_ids]
        assert {s.seq_id for s in admitted} <= before_waiting | {s.seq_id for s, _, _ in preempted}
        assert step.seqs == kept + admitted                  # newcomers come last
        # running sequences keep their order; on each target rank the ones left out are that
        # rank's newest (preempted by an older sequence of the same rank, or by themselves)
        assert kept == [s for s, _, _, _ in before_running if s.seq_id in kept_ids]
        for r in range(T):
            on_rank = [s for s, t, _, _ in before_running if t == r]
            kept_r = [s for s in on_rank if s.seq_id in kept_ids]
            assert kept_r == on_rank[:len(kept_r)], f"target rank {r} preempted a sequence older than a kept one"
        for s, t, d in preempted:
            if s not in admitted:
                assert s.status is SequenceStatus.WAITING and s.target_computed == 0 and s.draft_computed == 0
                assert not any(p.has(s.seq_id) for p in sched.target_pools + sched.draft_pools)
            assert s.seq_id not in self.finished
            order = [x for x, _, _, _ in before_running]
            newer = [x.seq_id for x, xt, _, _ in before_running[order.index(s) + 1:]
                     if xt != t and x.seq_id in kept_ids]
            self.preemptions.append(Preemption(step.step_id, s.seq_id, t, newer))
            del self.ranks[s.seq_id]
            self._owe(s.seq_id, t, d)
        if preempted and kept:
            assert not admitted, "a step that had to preempt admits nobody"

        # ranks: sticky while running, in range, recorded at admission
        for s, t, d, _ in before_running:
            assert (s.target_rank, s.draft_rank) == (t, d) or s.seq_id not in kept_ids, \
                f"running seq {s.seq_id} moved"
        for s in kept:
            assert self.ranks[s.seq_id] == (s.target_rank, s.draft_rank), f"running seq {s.seq_id} moved"
        for s in admitted:
            assert s.seq_id not in self.ranks
            assert 0 <= s.target_rank < T and 0 <= s.draft_rank < max(D, 1)
            self.ranks[s.seq_id] = (s.target_rank, s.draft_rank)
            self.placements.append((s.seq_id, s.target_rank, s.draft_rank))
        assert set(self.ranks) == {s.seq_id for s in sched.running} == set(ids)
        if self.check_balance:
            t_load, d_load = [0] * T, [0] * max(D, 1)
            for s in kept:
                t_load[s.target_rank] += s.num_tokens
                d_load[s.draft_rank] += s.num_tokens
            for s in admitted:
                assert t_load[s.target_rank] == min(t_load), (s.seq_id, t_load)
                assert d_load[s.draft_rank] == min(d_load), (s.seq_id, d_load)
                t_load[s.target_rank] += s.num_tokens
                d_load[s.draft_rank] += s.num_tokens

        for s in step.seqs:
            n = s.num_tokens
            assert s.seq_id not in self.finished and s.status is SequenceStatus.RUNNING
            assert s.step_len == n
            if not D:
                assert s.step_k == 0
        # target plans: exactly the rank's sequences, in step order, and exactly its frees
        for r in range(T):
            seqs = step.target_seqs[r]
            assert seqs == [s for s in step.seqs if s.target_rank == r]
            plan = step.target_plans[r]
            frees = self._frees_t[r]
            if not seqs and not frees:
                assert plan is None, f"target rank {r} got a plan with nothing in it"
                continue
            # One k for the whole step: its longest proposal.
            assert plan is not None and plan.step_id == step.step_id and plan.k == step_k <= sched.k
            assert sorted(plan.free_seq_ids) == sorted(frees), f"target rank {r} frees"
            frees.clear()
            assert plan.seq_ids == [s.seq_id for s in seqs]
            for i, s in enumerate(seqs):
                n = s.num_tokens
                assert plan.num_computed[i] == s.target_computed
                assert plan.num_new[i] == n - s.target_computed >= 1
                assert plan.num_slots[i] == n + s.step_k
                assert plan.proposal_lens[i] == s.step_k
        # draft plans: the rank's sequences that speculate this step, and its frees
        for d in range(D):
            seqs = step.draft_seqs[d]
            assert seqs == [s for s in step.seqs if s.step_k > 0 and s.draft_rank == d]
            plan = step.draft_plans[d]
            frees = self._frees_d[d]
            if not seqs and not frees:
                assert plan is None, f"draft rank {d} got a plan with nothing in it"
                continue
            assert plan is not None and plan.step_id == step.step_id and plan.k == step_k
            assert sorted(plan.free_seq_ids) == sorted(frees), f"draft rank {d} frees"
            frees.clear()
            assert plan.seq_ids == [s.seq_id for s in seqs]
            for i, s in enumerate(seqs):
                assert plan.num_computed[i] == s.draft_computed
                assert plan.num_slots[i] == s.num_tokens + s.step_k - 1
                assert plan.proposal_lens[i] == s.step_k

    def check_mirrors(self, step: ScheduledStep) -> None:
        """Once every worker has applied the step's plan it has seen exactly the operations
        the driver's mirror of its pool has: the same blocks per sequence and the same free
        count. A worker holds only sequences that run on its rank.

        The one exception is a sequence requeued mid-step by a dead target worker after its
        draft worker already ran it: the mirror let it go, the draft worker hears so with its
        next plan, so it is compared as if that owed free were applied already."""
        sched = self.sched
        pairs = [(mirror, worker, {s.seq_id for s in sched.running if s.target_rank == r}, self._frees_t[r])
                 for r, (mirror, worker) in enumerate(zip(sched.target_pools, self.targets))]
        if sched.num_draft_ranks:
            on_draft = [{s.seq_id for s in sched.running if s.draft_rank == d} for d in range(sched.num_draft_ranks)]
            for d, mirror in enumerate(sched.draft_pools):
                pairs.append((mirror, self.drafts[d], on_draft[d], self._frees_d[d]))
            for d, worker in enumerate(self.drafts[:sched.num_draft_ranks]):
                assert set(worker.cache) <= on_draft[d] | self._frees_d[d], f"{worker.name} holds another rank's sequence"
        for mirror, worker, owners, owed in pairs:
            assert set(mirror._tables) <= owners, "a sequence holds blocks on a rank it does not run on"
            assert set(worker.cache) <= owners | owed, f"{worker.name} holds a sequence it was told to free"
            held_by_owed = sum(len(worker.blocks.block_table(sid)) for sid in owed)
            assert mirror.num_free_blocks == worker.blocks.num_free_blocks + held_by_owed
            for sid in (set(mirror._tables) | set(worker.blocks._tables)) - owed:
                assert len(mirror.block_table(sid)) == len(worker.blocks.block_table(sid))

    def propose(self, step: ScheduledStep, truth: dict[int, list[int]]) -> None:
        proposed: dict[int, list[int]] = {}
        confidence: dict[int, list[float]] = {}
        shards: list[Proposals] = []
        for d, dplan in enumerate(step.draft_plans):
            if dplan is None:
                continue
            if d in self.fail_drafts:
                # its sequences verify without proposals this step
                self.kill_draft(d, step)
                continue
            plan = roundtrip(dplan)
            k = plan.k
            worker = self.drafts[d]
            histories = worker.apply(plan, truth)
            rows = []
            for i, sid in enumerate(plan.seq_ids):
                k_i = plan.proposal_lens[i]
                if self.shorten is not None:
                    k_i = self.shorten(sid, len(histories[i]), k_i)
                    assert 0 <= k_i <= plan.proposal_lens[i]
                hist = histories[i]
                props, conf = [], []
                for _ in range(k_i):
                    t = true_next(hist + props)
                    wrong = self.draft_wrong(sid, len(hist) + len(props))
                    if wrong:
                        t = (t + 1) % V
                    props.append(t)
                    # A well-informed fake draft: unsure exactly where it is wrong. Like
                    # DraftWorker it stops once the product falls below its floor.
                    conf.append(0.3 if wrong else 0.9)
                    if plan.min_reach and math.prod(conf) < plan.min_reach[i]:
                        break
                k_i = len(props)
                if plan.min_reach:
                    confidence[sid] = conf
                # the draft ran its first k_i - 1 proposals through the model: they are in its KV
                worker.cache[sid].extend(props[:k_i - 1])
                assert len(worker.cache[sid]) <= worker.blocks.num_slots(sid)
                rows.append((sid, props))
                proposed[sid] = props
            if plan.num_seqs:
                self.counts.draft_calls += 1
            # several shards per draft rank
            for j in range(self.num_shards):
                part = rows[j::self.num_shards]
                toks = [t for _, p in part for t in p + [-1] * (k - len(p))]
                conf = [c for sid, p in part for c in confidence[sid] + [0.0] * (k - len(p))] if confidence else []
                shards.append(Proposals(step_id=plan.step_id, k=k, has_probs=self.probs and j % 2 == 0,
                                        seq_ids=[s for s, _ in part], proposal_lens=[len(p) for _, p in part],
                                        token_ids=toks, confidence=conf))
        # every target rank gets all shards, in scrambled order: other ranks' rows are skipped
        shards = [decode(encode(s), expected=Proposals) for s in reversed(shards)]
        prob_rows = [sid for s in shards if s.has_probs for sid in s.seq_ids]
        for r, tplan in enumerate(step.target_plans):
            # like Engine.step: when every draft call failed no proposals are attached at all
            if tplan is None or not tplan.seq_ids or not shards:
                continue
            merged = merge_proposals(tplan.seq_ids, tplan.k, shards)
            for i, sid in enumerate(tplan.seq_ids):
                props = proposed.get(sid, [])
                assert merged.proposal_lens[i] == len(props)
                assert merged.token_ids[i * tplan.k:(i + 1) * tplan.k] == props + [-1] * (tplan.k - len(props))
                if merged.draft_rows[i] != -1:
                    assert props and prob_rows[merged.draft_rows[i]] == sid
                else:
                    assert not props or not any(sid in s.seq_ids for s in shards if s.has_probs)
            other = step.target_plans[:r] + step.target_plans[r + 1:]
            before = [(p.proposal_token_ids, p.proposal_lens) for p in other if p is not None]
            self.sched.attach_proposals(step, r, merged)
            assert step.target_plans[r].proposal_token_ids == merged.token_ids
            # attaching touches only that rank's plan
            assert [(p.proposal_token_ids, p.proposal_lens) for p in other if p is not None] == before

    def verify(self, step: ScheduledStep, truth: dict[int, list[int]]) -> list[StepResult | None]:
        results: list[StepResult | None] = []
        for r, tplan in enumerate(step.target_plans):
            if tplan is None:
                results.append(None)
                continue
            if r in self.fail_targets:
                # its sequences are requeued with every token they had; update gets None for it
                self.kill_target(r, step)
                results.append(None)
                continue
            plan = roundtrip(tplan)
            k = plan.k
            worker = self.targets[r]
            histories = worker.apply(plan, truth)
            num_emitted, token_ids = [], []
            for i, sid in enumerate(plan.seq_ids):
                k_i = plan.proposal_lens[i] if plan.proposal_token_ids else 0
                props = plan.proposal_token_ids[i * k:i * k + k_i]
                assert -1 not in props
                if plan.proposal_token_ids:
                    assert plan.proposal_token_ids[i * k + k_i:(i + 1) * k] == [-1] * (k - k_i)
                worker.cache[sid].extend(props)
                assert len(worker.cache[sid]) <= worker.blocks.num_slots(sid)
                hist = histories[i]
                out: list[int] = []
                for p in props:
                    t = true_next(hist + out)
                    out.append(t)
                    if p != t:
                        break
                else:
                    out.append(true_next(hist + out))   # every proposal accepted: bonus token
                num_emitted.append(len(out))
                token_ids.extend(out)
                self.counts.drafted += k_i
                self.counts.accepted += len(out) - 1
                self.counts.emitted += len(out)
            self.counts.seq_steps += plan.num_seqs
            result = StepResult(step_id=plan.step_id, seq_ids=list(plan.seq_ids), num_emitted=num_emitted,
                                token_ids=token_ids)
            results.append(decode(encode(result), expected=StepResult))
        self.counts.steps += 1
        return results

    def run(self, max_steps: int = 10_000) -> None:
        for _ in range(max_steps):
            if not self.sched.has_work:
                return
            assert self.step(), "scheduler has work but scheduled nothing"
        raise AssertionError("did not finish")


def _per_rank(blocks, ranks: int) -> list:
    if isinstance(blocks, (list, tuple)):
        assert len(blocks) == ranks or ranks == 1
        return list(blocks)
    return [blocks] * ranks


def build(k: int = 4, target_max_len: int = 256, draft_max_len: int | None = None, block_size: int = 4,
          target_blocks: int | list[int] = 1000, draft_blocks: int | list[int] | None = 1000,
          target_ranks: int = 1, draft_ranks: int = 1, **cfg) -> Engine:
    """A scheduler with ample pools by default; ``draft_blocks=None``: proposers without a KV
    pool (n-gram style). Pool sizes are per rank (an int: the same for every rank). The fake
    workers' pools are the same size as the mirrors. One rank is passed as a bare pool (the
    single-pool form of the API), several as a list."""
    config = SchedulerConfig(num_speculative_tokens=k, target_max_len=target_max_len, draft_max_len=draft_max_len,
                             **cfg)
    t_sizes = _per_rank(target_blocks, target_ranks)
    tpools = [BlockManager(n, block_size) for n in t_sizes]
    if draft_blocks is None:
        d_sizes = [2000] * draft_ranks
        dpools = None
    else:
        d_sizes = _per_rank(draft_blocks, draft_ranks)
        dpools = [BlockManager(n, block_size) for n in d_sizes]
        dpools = dpools[0] if len(dpools) == 1 else dpools
    sched = Scheduler(config, tpools[0] if len(tpools) == 1 else tpools, dpools, num_proposers=len(d_sizes))
    targets = [FakeWorker(f"target{r}", n, block_size) for r, n in enumerate(t_sizes)]
    drafts = [FakeWorker(f"draft{d}", n, block_size) for d, n in enumerate(d_sizes)]
    return Engine(sched, targets, drafts)


# ======================================================================================
# tests
# ======================================================================================


def add_requests(eng: Engine, specs, stop_ids=()) -> dict[int, tuple[list[int], str]]:
    """specs: (seq_id, prompt_len, max_tokens). Returns the reference output per seq."""
    ref = {}
    for sid, plen, mt in specs:
        prompt = prompt_for(sid, plen)
        eng.sched.add(make_seq(sid, prompt, mt, stop_ids))
        ref[sid] = reference(prompt, mt, stop_ids, eng.sched.config.target_max_len)
    return ref


def assert_matches_reference(eng: Engine, ref) -> None:
    assert set(eng.finished) == set(ref)
    for sid, (tokens, reason) in ref.items():
        seq = eng.finished[sid]
        assert seq.output_tokens == tokens, f"seq {sid}"
        assert seq.finish_reason == reason, f"seq {sid}"
        assert seq.status is SequenceStatus.FINISHED
    s = eng.sched
    assert not s.running and not s.waiting
    assert s.stats.num_requests_finished == len(ref)
    for pool in s.target_pools + s.draft_pools:
        assert pool.num_free_blocks == pool.num_blocks
    # the last frees are still owed: they travel with the next plan
    pending_t = [sorted(f) for f in s._target_frees]
    assert pending_t == [sorted(f) for f in eng._frees_t]
    assert [sorted(f) for f in s._draft_frees] == [sorted(f) for f in eng._frees_d]


def expected_k(cfg: SchedulerConfig, k: int, n: int, remaining: int) -> int:
    """The proposal-length rule of DESIGN.md, written out independently."""
    if k == 0:
        return 0
    k_i = max(0, min(k, remaining - 1, cfg.target_max_len - n - 1))
    if cfg.draft_max_len is not None and n + k_i > cfg.draft_max_len:
        return 0
    return k_i


MIXED = [(i, 1 + (7 * i) % 40, 1 + (11 * i) % 45) for i in range(1, 25)]


# -- (a) greedy equivalence ----------------------------------------------------------------

@pytest.mark.parametrize("k", [0, 1, 2, 4, 7])
def test_outputs_equal_plain_greedy_decoding(k):
    eng = build(k=k)
    ref = add_requests(eng, MIXED)
    eng.run()
    assert_matches_reference(eng, ref)
    c, st = eng.counts, eng.sched.stats
    if k:
        assert 0 < c.accepted < c.drafted     # both acceptances and rejections happened
        assert st.num_steps < sum(len(t) for t, _ in ref.values())
    else:
        assert c.drafted == 0 and c.draft_calls == 0
    assert st.num_preemptions == 0


def test_no_proposer_plain_decoding():
    eng = build(k=4, use_proposer=False, draft_blocks=None)
    ref = add_requests(eng, MIXED)
    eng.run()
    assert_matches_reference(eng, ref)
    assert eng.sched.k == 0 and eng.counts.draft_calls == 0
    assert eng.sched.stats.num_emitted_tokens == eng.sched.stats.num_seq_steps
    assert sum(len(t) for t, _ in ref.values()) == eng.sched.stats.num_emitted_tokens


def test_proposer_without_draft_pool_ngram_style():
    eng = build(k=3, draft_blocks=None)
    assert eng.sched.draft_pools == [] and eng.sched.num_draft_ranks == 1
    ref = add_requests(eng, MIXED[:10])
    eng.run()
    assert_matches_reference(eng, ref)
    assert eng.counts.accepted > 0


@pytest.mark.parametrize("with_pool", [True, False])
def test_proposer_may_propose_fewer_than_planned(with_pool):
    eng = build(k=4, draft_blocks=1000 if with_pool else None)
    eng.shorten = lambda sid, pos, k_i: (sid + pos) % (k_i + 1)
    ref = add_requests(eng, MIXED)
    eng.run()
    assert_matches_reference(eng, ref)
    st, c = eng.sched.stats, eng.counts
    assert st.num_draft_tokens == c.drafted and st.num_accepted_tokens == c.accepted > 0


def test_a_perfect_draft_emits_k_plus_one_per_step():
    eng = build(k=4)
    eng.draft_wrong = lambda sid, pos: False
    ref = add_requests(eng, [(1, 5, 21)])
    eng.run()
    assert_matches_reference(eng, ref)
    st = eng.sched.stats
    # 21 tokens = 4 steps of 5 plus one step where k_i = remaining - 1 = 0
    assert st.num_steps == 5 and st.num_emitted_tokens == 21
    assert st.num_draft_tokens == 16 == st.num_accepted_tokens


# -- (b) continuous batching ---------------------------------------------------------------

def test_requests_added_between_steps_join_running_ones():
    eng = build(k=3)
    eng.keep_steps = True
    ref = add_requests(eng, [(1, 4, 40), (2, 9, 40), (3, 2, 40)])
    joined = []
    next_id = 4
    while eng.sched.has_work:
        assert eng.step()
        if next_id <= 12 and len(eng.steps) % 2 == 1:
            ref |= add_requests(eng, [(next_id, 1 + next_id % 6, 5 + 3 * next_id)])
            joined.append((next_id, len(eng.steps)))
            next_id += 1
    assert_matches_reference(eng, ref)
    for sid, after in joined:
        nxt = eng.steps[after]             # the very next step
        t = nxt.target_plans[0]
        ids = t.seq_ids
        assert ids[-1] == sid              # joins at the end of the batch ...
        assert len(ids) > 1                # ... next to sequences already running
        assert t.num_computed[-1] == 0 and t.num_new[-1] == len(prompt_for(sid, 1 + sid % 6))
    assert max(len(s.seqs) for s in eng.steps) >= 5


def test_max_num_seqs_and_token_budget_limit_admission():
    eng = build(k=2, max_num_seqs=3, max_num_batched_tokens=20)
    eng.keep_steps = True
    ref = add_requests(eng, [(i, 8, 6) for i in range(1, 9)])
    eng.run()
    assert_matches_reference(eng, ref)
    assert max(len(s.seqs) for s in eng.steps) == 3
    # first step: two 8-token prompts fit the 20-token budget, a third does not
    assert eng.steps[0].target_plans[0].seq_ids == [1, 2]
    for s in eng.steps:
        assert sum(s.target_plans[0].num_new) <= 20


def test_a_single_prompt_over_the_token_budget_still_runs_alone():
    eng = build(k=2, max_num_batched_tokens=4)
    eng.keep_steps = True
    ref = add_requests(eng, [(1, 10, 3), (2, 10, 3)])
    eng.run()
    assert_matches_reference(eng, ref)
    assert eng.steps[0].target_plans[0].seq_ids == [1]


# -- (c) KV exhaustion -------------------------------------------------------------------------

KV_SPECS = [(i, 5 + (3 * i) % 16, 20 + (7 * i) % 11) for i in range(1, 11)]


def run_kv(**kw) -> Engine:
    eng = build(k=4, target_max_len=64, **kw)
    ref = add_requests(eng, KV_SPECS)
    eng.run()
    assert_matches_reference(eng, ref)
    return eng


def test_tiny_target_pool_preempts_and_still_matches():
    ample = run_kv()
    assert ample.sched.stats.num_preemptions == 0
    tiny = run_kv(target_blocks=18)      # one sequence at full length needs 16
    st = tiny.sched.stats
    assert st.num_preemptions > 0
    assert sum(s.num_preemptions for s in tiny.finished.values()) == st.num_preemptions
    assert {s: q.output_tokens for s, q in tiny.finished.items()} == \
        {s: q.output_tokens for s, q in ample.finished.items()}
    assert st.num_steps > ample.sched.stats.num_steps


def test_tiny_draft_pool_lowers_k_without_preempting():
    ample = run_kv()
    tiny = run_kv(draft_blocks=6)
    assert tiny.sched.stats.num_preemptions == 0
    assert 0 < tiny.counts.drafted < ample.counts.drafted
    assert tiny.sched.stats.num_draft_tokens == tiny.counts.drafted


def test_tiny_pools_on_both_sides():
    eng = run_kv(target_blocks=17, draft_blocks=5)
    assert eng.sched.stats.num_preemptions > 0


@pytest.mark.parametrize("block_size,blocks", [(1, 64), (2, 33), (8, 9), (16, 5)])
def test_exhaustion_across_block_sizes(block_size, blocks):
    eng = build(k=3, target_max_len=64, block_size=block_size, target_blocks=blocks, draft_blocks=blocks)
    ref = add_requests(eng, KV_SPECS)
    eng.run()
    assert_matches_reference(eng, ref)
    assert eng.sched.stats.num_preemptions > 0


def test_preempted_sequences_requeue_oldest_first():
    eng = build(k=2, target_max_len=64, target_blocks=18)
    ref = add_requests(eng, KV_SPECS)
    preempt_steps = 0

    def check(step):
        nonlocal preempt_steps
        preempted = [s for s in eng.sched.waiting if s.num_tokens > s.prompt_len]
        # a preempted sequence (it has output) waits ahead of never-run ones, oldest first
        assert [s.seq_id for s in list(eng.sched.waiting)[:len(preempted)]] == sorted(s.seq_id for s in preempted)
        if eng.sched.stats.num_preemptions > before[0]:
            # a step that had to preempt admits nobody
            preempt_steps += 1
            assert all(s.seq_id in running_before for s in step.seqs)
    before = [0]
    running_before: set[int] = set()
    eng.on_plan = check
    orig_step = eng.step

    def step():
        before[0] = eng.sched.stats.num_preemptions
        running_before.clear()
        running_before.update(s.seq_id for s in eng.sched.running)
        return orig_step()
    eng.step = step
    eng.run()
    assert_matches_reference(eng, ref)
    assert eng.sched.stats.num_preemptions > 0 and preempt_steps > 0


def test_pool_too_small_for_one_request_raises():
    eng = build(k=2, target_max_len=64, target_blocks=2)
    add_requests(eng, [(1, 9, 4)])
    with pytest.raises(RuntimeError, match="KV pool too small"):
        eng.sched.schedule()


# -- (d) proposal lengths and max lengths ---------------------------------------------------------

def k_checker(eng: Engine):
    cfg, k = eng.sched.config, eng.sched.k
    seen = []

    def check(step):
        for s in step.seqs:
            n = s.num_tokens
            assert s.step_k == expected_k(cfg, k, n, s.remaining), (s.seq_id, n, s.remaining)
            assert s.step_k <= s.remaining - 1 or s.step_k == 0
            assert n + s.step_k + 1 <= cfg.target_max_len
            if s.step_k and cfg.draft_max_len is not None:
                assert n + s.step_k <= cfg.draft_max_len
            seen.append((n, s.remaining, s.step_k))
    eng.on_plan = check
    return seen


def test_proposal_length_rule_with_ample_pools():
    eng = build(k=5, target_max_len=80)
    seen = k_checker(eng)
    ref = add_requests(eng, [(i, 1 + (5 * i) % 70, 1 + (13 * i) % 30) for i in range(1, 30)])
    eng.run()
    assert_matches_reference(eng, ref)
    ks = {k for _, _, k in seen}
    assert ks == {0, 1, 2, 3, 4, 5}
    assert any(r == 1 and k == 0 for _, r, k in seen)   # the last token is never speculated


def test_draft_max_len_turns_speculation_off():
    eng = build(k=4, target_max_len=64, draft_max_len=24)
    eng.keep_steps = True
    seen = k_checker(eng)
    ref = add_requests(eng, [(1, 10, 40), (2, 3, 45), (3, 20, 30), (4, 23, 5), (5, 24, 5)])
    eng.run()
    assert_matches_reference(eng, ref)
    assert any(k > 0 for _, _, k in seen)
    assert all(k == 0 for n, _, k in seen if n + 1 > 24)
    assert all(k == 0 for n, _, k in seen if n >= 21)   # n + 4 > 24 (remaining is large)
    for s in eng.steps:
        for d in s.draft_plans:
            if d is not None:
                assert all(slots <= 24 - 1 for slots in d.num_slots)   # n + k_i - 1


def test_target_max_len_caps_and_finishes_with_length():
    tml = 32
    eng = build(k=4, target_max_len=tml)
    seen = k_checker(eng)
    specs = [(1, 31, 100), (2, 30, 100), (3, 29, 100), (4, 27, 100), (5, 20, 100), (6, 1, 100)]
    ref = add_requests(eng, specs)
    eng.run()
    assert_matches_reference(eng, ref)
    for sid, plen, _ in specs:
        seq = eng.finished[sid]
        assert seq.num_tokens <= tml
        if seq.finish_reason == "length":
            assert seq.num_tokens == tml
    assert eng.finished[1].output_tokens == [true_next(prompt_for(1, 31))]
    assert any(k for n, _, k in seen if n == tml - 2) and all(k <= 1 for n, _, k in seen if n == tml - 2)
    assert all(k == 0 for n, _, k in seen if n == tml - 1)


@pytest.mark.parametrize("plen", [32, 33, 100])
def test_prompt_without_room_is_rejected(plen):
    eng = build(k=4, target_max_len=32)
    with pytest.raises(ValueError, match="max_model_len"):
        eng.sched.add(make_seq(1, prompt_for(1, plen), 10))
    assert not eng.sched.has_work


# -- (e) stop tokens -----------------------------------------------------------------------------

def find_seq_with_fresh_token_at(index: int, plen: int = 4, length: int = 12):
    for sid in range(1, 500):
        out, _ = reference(prompt_for(sid, plen), length)
        if out[index] not in out[:index] and out[index] not in prompt_for(sid, plen):
            return sid, out
    raise AssertionError("no such sequence")


@pytest.mark.parametrize("index", [0, 2, 4, 7])
def test_stop_token_mid_step_discards_the_rest(index):
    sid, out = find_seq_with_fresh_token_at(index)
    stop = out[index]
    eng = build(k=4)
    eng.draft_wrong = lambda s, p: False         # every step emits k + 1 = 5 tokens
    eng.keep_steps = True
    eng.sched.add(make_seq(sid, prompt_for(sid, 4), 50, stop_ids=[stop]))
    eng.sched.add(make_seq(sid + 1000, prompt_for(sid + 1000, 4), 30))
    eng.run()
    seq = eng.finished[sid]
    assert seq.finish_reason == "stop"
    assert seq.output_tokens == out[:index + 1]
    assert seq.tokens[-1] == stop
    stop_step = index // 5                       # steps emit 5 tokens each
    assert eng.counts.emitted == eng.sched.stats.num_emitted_tokens
    # the step where it stopped had emitted all 5, the sequence kept index % 5 + 1
    st, res = eng.steps[stop_step], eng.results[stop_step][0]
    i = st.target_plans[0].seq_ids.index(sid)
    assert res.num_emitted[i] == 5
    emitted = res.token_ids[sum(res.num_emitted[:i]):sum(res.num_emitted[:i + 1])]
    assert emitted == out[5 * stop_step:5 * stop_step + 5]
    assert seq.output_tokens == out[:5 * stop_step] + emitted[:index % 5 + 1]
    # from the next step on it is gone, and the workers were told to free it
    later = eng.steps[stop_step + 1]
    assert sid not in later.target_plans[0].seq_ids
    assert sid in later.target_plans[0].free_seq_ids
    assert later.draft_plans[0] is not None and sid in later.draft_plans[0].free_seq_ids
    assert sid not in eng.target.cache and sid not in eng.draft.cache
    assert not eng.sched.target_pools[0].has(sid) and not eng.sched.draft_pools[0].has(sid)


def test_update_returns_only_tokens_up_to_the_stop():
    sid, out = find_seq_with_fresh_token_at(1)
    eng = build(k=4)
    eng.draft_wrong = lambda s, p: False
    eng.sched.add(make_seq(sid, prompt_for(sid, 4), 50, stop_ids=[out[1]]))
    step = eng.sched.schedule()
    truth = eng.truth(step)
    eng.propose(step, truth)
    [result] = eng.verify(step, truth)
    assert result.num_emitted == [5]
    [(seq, appended)] = eng.sched.update(step, [result])
    assert appended == out[:2] and seq.finished and seq.finish_reason == "stop"
    assert eng.sched.stats.num_emitted_tokens == 5 and eng.sched.stats.num_accepted_tokens == 4
    assert not eng.sched.has_work


def test_stop_ids_in_the_prompt_do_not_stop_and_late_stops_do_not_matter():
    prompt = prompt_for(3, 6)
    out, _ = reference(prompt, 8)
    never = [t for t in range(V) if t not in out][:3]
    eng = build(k=3)
    eng.sched.add(make_seq(3, prompt, 8, stop_ids=[t for t in prompt if t not in out] + never))
    eng.run()
    assert eng.finished[3].output_tokens == out and eng.finished[3].finish_reason == "length"


def test_stop_token_wins_over_length_on_the_last_token():
    sid, out = find_seq_with_fresh_token_at(5)
    eng = build(k=4)
    eng.sched.add(make_seq(sid, prompt_for(sid, 4), 6, stop_ids=[out[5]]))
    eng.run()
    assert eng.finished[sid].finish_reason == "stop" and eng.finished[sid].output_tokens == out[:6]


# -- (f) metrics -------------------------------------------------------------------------------

def test_stats_match_independent_counts_and_design_definitions():
    eng = build(k=4, target_max_len=64, target_blocks=20)
    ref = add_requests(eng, KV_SPECS, stop_ids=[5, 17])
    eng.run()
    assert_matches_reference(eng, ref)
    st, c = eng.sched.stats, eng.counts
    assert st.num_draft_tokens == c.drafted
    assert st.num_accepted_tokens == c.accepted
    assert st.num_emitted_tokens == c.emitted
    assert st.num_seq_steps == c.seq_steps
    assert st.num_steps == c.steps
    assert c.emitted == c.accepted + c.seq_steps
    assert sum(s.num_draft_tokens for s in eng.finished.values()) == c.drafted
    assert sum(s.num_accepted_tokens for s in eng.finished.values()) == c.accepted
    d = st.as_dict()
    assert d["acceptance_rate"] == pytest.approx(c.accepted / c.drafted)
    assert d["mean_accepted_length"] == pytest.approx(c.emitted / c.seq_steps)
    assert d["system_efficiency"] == pytest.approx(c.emitted / (c.seq_steps * (4 + 1)))
    assert 0 < d["acceptance_rate"] < 1 and 1 < d["mean_accepted_length"] < 5
    for key in ("num_draft_tokens", "num_accepted_tokens", "num_emitted_tokens", "num_steps",
                "num_seq_steps", "num_preemptions", "num_requests_finished"):
        assert d[key] == getattr(st, key)
    assert d["num_requests_finished"] == len(ref)


def test_stats_when_nothing_ran():
    d = build(k=3).sched.stats.as_dict()
    assert d["acceptance_rate"] == d["mean_accepted_length"] == d["system_efficiency"] == 0.0
    assert d["tokens_per_s"] == 0.0


def test_update_rejects_a_result_for_another_batch_or_too_many_accepts():
    eng = build(k=2)
    add_requests(eng, [(1, 3, 10), (2, 3, 10)])
    step = eng.sched.schedule()
    with pytest.raises(ValueError, match="batch"):
        eng.sched.update(step, [StepResult(step_id=step.step_id, seq_ids=[2, 1], num_emitted=[1, 1],
                                           token_ids=[0, 0])])
    with pytest.raises(ValueError, match="batch"):
        eng.sched.update(step, [None])
    with pytest.raises(ValueError, match="batch"):
        eng.sched.update(step, [])
    # no proposals attached: nothing was proposed, so anything but the one verified token is too many
    with pytest.raises(ValueError, match="emitted 2 tokens for 0 proposals"):
        eng.sched.update(step, [StepResult(step_id=step.step_id, seq_ids=[1, 2], num_emitted=[1, 2],
                                           token_ids=[0] * 3)])
    # proposals attached: k_i = 2 proposed, so 4 emitted is too many (3 = 2 accepted + bonus is not)
    eng.propose(step, eng.truth(step))
    assert step.target_plans[0].proposal_lens == [2, 2]
    with pytest.raises(ValueError, match="emitted 4 tokens for 2 proposals"):
        eng.sched.update(step, [StepResult(step_id=step.step_id, seq_ids=[1, 2], num_emitted=[3, 4],
                                           token_ids=[0] * 7)])
    # nothing was applied by the rejected results
    assert [s.num_tokens for s in step.seqs] == [3, 3] and eng.sched.stats.num_steps == 0
    assert all(s.target_computed == 0 for s in step.seqs)


# -- (g) randomized property test -----------------------------------------------------------------

@pytest.mark.parametrize("scenario", range(40))
def test_random_scenarios(scenario):
    rng = random.Random(1000 + scenario)
    k = rng.choice([0, 1, 2, 3, 4, 6])
    block_size = rng.choice([1, 2, 3, 4, 8])
    tml = rng.randrange(8, 72)
    dml = rng.choice([None, None, rng.randrange(4, tml + 8)])
    need = -(-(tml - 1) // block_size)                    # one sequence at full length
    target_blocks = rng.choice([need, need + 1, need + rng.randrange(0, 3 * need), 10 * need])
    draft_blocks = rng.choice([None, 1, rng.randrange(1, 2 * need + 2), 10 * need])
    eng = build(k=k, target_max_len=tml, draft_max_len=dml, block_size=block_size, target_blocks=target_blocks,
                draft_blocks=draft_blocks, max_num_seqs=rng.randrange(1, 8),
                max_num_batched_tokens=rng.randrange(1, 120))
    wrong_mod = rng.randrange(1, 6)
    eng.draft_wrong = lambda sid, pos: (sid * 5 + pos * 3) % 7 < wrong_mod - 1
    eng.num_shards = rng.randrange(1, 4)
    if rng.random() < 0.3:
        eng.shorten = lambda sid, pos, k_i: (3 * sid + pos) % (k_i + 1)
    stop_ids = rng.sample(range(V), rng.randrange(0, 4))
    max_seqs = eng.sched.config.max_num_seqs
    max_batched = eng.sched.config.max_num_batched_tokens

    total = rng.randrange(1, 16)
    ref: dict[int, tuple[list[int], str]] = {}
    params: dict[int, int] = {}
    next_id = 1

    admitted_now: set[int] = set()

    def check(step):
        assert len(step.seqs) <= max_seqs
        # fed tokens respect the budget once more than a lone first request is admitted
        admitted = [i for i, s in enumerate(step.seqs) if s.seq_id in admitted_now]
        if admitted and (admitted[0] > 0 or len(admitted) > 1):
            assert sum(sum(p.num_new) for p in step.target_plans if p is not None) <= max_batched
        for i, s in enumerate(step.seqs):
            assert (i in admitted) == (i >= len(step.seqs) - len(admitted))   # newcomers come last
            # a short pool only ever turns speculation off, never changes the rule otherwise
            assert s.step_k in (0, expected_k(eng.sched.config, k, s.num_tokens, s.remaining))
    eng.on_plan = check

    steps = 0
    while next_id <= total or eng.sched.has_work:
        while next_id <= total and (not eng.sched.has_work or rng.random() < 0.3):
            plen = rng.randrange(1, tml)
            mt = rng.randrange(1, 40)
            ref |= add_requests(eng, [(next_id, plen, mt)], stop_ids)
            params[next_id] = mt
            next_id += 1
        admitted_now = {s.seq_id for s in eng.sched.waiting}
        assert eng.step()
        steps += 1
        assert steps < 5000
        for s in eng.sched.running:
            assert s.output_len <= params[s.seq_id] and s.num_tokens <= tml
    assert_matches_reference(eng, ref)
    for sid, seq in eng.finished.items():
        assert 1 <= seq.output_len <= params[sid]
        assert seq.num_tokens <= tml
    assert len(eng.finished) == total


# -- smaller pieces ---------------------------------------------------------------------------------

@pytest.mark.parametrize("kw,field_name", [
    (dict(num_speculative_tokens=-1, target_max_len=10), "num_speculative_tokens"),
    (dict(num_speculative_tokens=2, target_max_len=1), "max_model_len"),
    (dict(num_speculative_tokens=2, target_max_len=10, max_num_seqs=0), "max_num_seqs"),
    (dict(num_speculative_tokens=2, target_max_len=10, max_num_batched_tokens=0), "max_num_batched_tokens"),
])
def test_scheduler_config_validates(kw, field_name):
    with pytest.raises(ValueError, match=field_name):
        SchedulerConfig(**kw)


@pytest.mark.parametrize("n,remaining,dml,expect", [
    (10, 100, None, 4),
    (10, 5, None, 4),
    (10, 4, None, 3),      # the bonus token must fit in max_tokens
    (10, 1, None, 0),
    (58, 100, None, 4),    # 58 + 4 + 1 = 63 <= 64
    (60, 100, None, 3),    # capped by target_max_len
    (62, 100, None, 1),
    (63, 100, None, 0),
    (20, 100, 24, 4),      # 20 + 4 = 24: the draft still sees every position
    (21, 100, 24, 0),      # 21 + 4 > 24: off, not shortened
    (22, 2, 24, 1),        # 22 + 1 <= 24
    (23, 2, 24, 1),
    (24, 2, 24, 0),
])
def test_proposal_len_table(n, remaining, dml, expect):
    eng = build(k=4, target_max_len=64, draft_max_len=dml)
    seq = make_seq(1, prompt_for(1, n), remaining)
    assert eng.sched.proposal_len(seq) == expect == expected_k(eng.sched.config, 4, n, remaining)


def test_plans_carry_sampling_knobs_and_seeds():
    eng = build(k=2)
    seq = Sequence(seq_id=9, request_id="r", prompt_len=3, tokens=[1, 2, 3], seed=2**63 - 1,
                   params=SamplingParams(max_tokens=5, temperature=0.8, top_k=7, top_p=0.5))
    eng.sched.add(seq)
    eng.sched.add(make_seq(10, [4, 5], 5))
    step = eng.sched.schedule()
    target, draft = step.target_plans[0], step.draft_plans[0]
    for plan in (target, draft):
        plan = roundtrip(plan)
        assert plan.seq_ids == [9, 10]
        assert plan.temperature == [0.8, 0.0] and plan.top_k == [7, 0] and plan.top_p == [0.5, 1.0]
        assert plan.seeds == [2**63 - 1, 10]
    assert target.token_ids == [1, 2, 3, 4, 5] and target.num_new == [3, 2]
    assert target.num_slots == [5, 4] and draft.num_slots == [4, 3]


def test_abort_all_releases_everything():
    eng = build(k=3, target_max_len=64, target_blocks=18)
    add_requests(eng, KV_SPECS)
    for _ in range(3):
        eng.step()
    running = [s.seq_id for s in eng.sched.running]
    assert running and eng.sched.waiting
    failed = eng.sched.abort_all("error")
    assert sorted(s.seq_id for s in failed) == sorted(set(sid for sid, _, _ in KV_SPECS) - set(eng.finished))
    assert all(s.finished and s.finish_reason == "error" for s in failed)
    assert not eng.sched.has_work and eng.sched.schedule() is None
    for pool in eng.sched.target_pools + eng.sched.draft_pools:
        assert pool.num_free_blocks == pool.num_blocks
    assert [sorted(f) for f in eng.sched._target_frees] == [sorted(running)]
    eng.sched.check_integrity()


# -- (h) several target and draft workers ----------------------------------------------------------

MANY = [(i, 1 + (7 * i) % 37, 1 + (11 * i) % 41) for i in range(1, 41)]
KV_MANY = [(i, 5 + (3 * i) % 16, 20 + (7 * i) % 11) for i in range(1, 25)]


def assert_every_rank_worked(eng: Engine) -> None:
    assert all(w.num_seq_plans > 0 for w in eng.targets), [w.num_seq_plans for w in eng.targets]
    if eng.sched.num_draft_ranks:
        assert all(w.num_seq_plans > 0 for w in eng.drafts), [w.num_seq_plans for w in eng.drafts]
    assert {t for _, t, _ in eng.placements} == set(range(len(eng.targets)))
    assert {d for _, _, d in eng.placements} == set(range(max(eng.sched.num_draft_ranks, 1)))


def test_scheduler_takes_one_pool_or_a_list():
    cfg = SchedulerConfig(num_speculative_tokens=3, target_max_len=64)
    one = BlockManager(10, 4)
    s = Scheduler(cfg, one, BlockManager(10, 4))
    assert s.target_pools == [one] and len(s.draft_pools) == 1 and s.num_draft_ranks == 1
    pools = [BlockManager(10, 4) for _ in range(3)]
    s = Scheduler(cfg, pools, (BlockManager(10, 4), BlockManager(10, 4)))
    assert s.target_pools == pools and len(s.draft_pools) == 2 and s.num_draft_ranks == 2
    s = Scheduler(cfg, pools, None, num_proposers=3)       # n-gram proposers: no draft KV
    assert s.draft_pools == [] and s.num_draft_ranks == 3
    s = Scheduler(SchedulerConfig(num_speculative_tokens=3, target_max_len=64, use_proposer=False), pools,
                  [BlockManager(10, 4)])
    assert s.k == 0 and s.num_draft_ranks == 0
    with pytest.raises(ValueError, match="target pool"):
        Scheduler(cfg, [])


@pytest.mark.parametrize("T,D,k", [(2, 3, 4), (3, 2, 2), (3, 3, 3), (2, 2, 0)])
def test_several_workers_equal_plain_greedy_decoding(T, D, k):
    eng = build(k=k, target_ranks=T, draft_ranks=D)
    eng.probs = True
    eng.num_shards = 2
    eng.check_balance = True           # ample pools: every newcomer goes to the least loaded ranks
    ref = add_requests(eng, MANY[:20])
    steps = 0
    while eng.sched.has_work:          # the rest join while the first ones run
        assert eng.step()
        steps += 1
        if steps % 2 and len(ref) < len(MANY):
            ref |= add_requests(eng, [MANY[len(ref)]])
    assert_matches_reference(eng, ref)
    assert_every_rank_worked(eng)
    c = eng.counts
    assert eng.sched.stats.num_preemptions == 0
    if k:
        assert 0 < c.accepted < c.drafted
    else:
        assert c.drafted == 0 and c.draft_calls == 0 and eng.sched.num_draft_ranks == 0


def test_several_ngram_proposers_without_draft_pools():
    eng = build(k=3, draft_blocks=None, target_ranks=2, draft_ranks=3)
    assert eng.sched.draft_pools == [] and eng.sched.num_draft_ranks == 3
    eng.shorten = lambda sid, pos, k_i: (sid + pos) % (k_i + 1)
    ref = add_requests(eng, MANY[:18])
    eng.run()
    assert_matches_reference(eng, ref)
    assert_every_rank_worked(eng)
    assert eng.counts.accepted > 0


@pytest.mark.parametrize("T,D,tblocks,dblocks,bs", [
    (2, 3, 18, 1000, 4),               # one sequence at full length needs 16 blocks
    (3, 2, 17, 6, 4),
    (2, 2, 17, 5, 4),
    (3, 3, [17, 20, 40], [5, 8, 1000], 4),
    (2, 3, 64, 64, 1),
    (3, 2, 9, 9, 8),
])
def test_several_workers_under_kv_pressure_preempt_and_still_match(T, D, tblocks, dblocks, bs):
    eng = build(k=4, target_max_len=64, block_size=bs, target_ranks=T, draft_ranks=D,
                target_blocks=tblocks, draft_blocks=dblocks)
    eng.probs = True
    ref = add_requests(eng, KV_MANY, stop_ids=[5])
    eng.run()                          # check_integrity and the per-rank mirror checks run every step
    assert_matches_reference(eng, ref)
    st = eng.sched.stats
    assert st.num_preemptions > 0 and len(eng.preemptions) == st.num_preemptions
    assert sum(s.num_preemptions for s in eng.finished.values()) == st.num_preemptions
    assert_every_rank_worked(eng)


def test_running_sequences_never_change_rank_and_preempted_ones_may():
    eng = build(k=3, target_max_len=64, target_ranks=3, draft_ranks=2, target_blocks=18, draft_blocks=12)
    seen: dict[int, list[tuple[int, int, int]]] = {}     # seq -> (step, target, draft) per step it ran

    def record(step):
        for s in step.seqs:
            seen.setdefault(s.seq_id, []).append((step.step_id, s.target_rank, s.draft_rank))
    eng.on_plan = record
    ref = add_requests(eng, KV_MANY)
    eng.run()
    assert_matches_reference(eng, ref)
    preempted_at = {}
    for p in eng.preemptions:
        preempted_at.setdefault(p.seq_id, []).append(p.step_id)
    moved = 0
    for sid, runs in seen.items():
        for (s0, t0, d0), (s1, t1, d1) in zip(runs, runs[1:]):
            if any(s0 < p <= s1 for p in preempted_at.get(sid, [])):
                moved += (t0, d0) != (t1, d1)
            else:
                assert (t0, d0) == (t1, d1), f"running seq {sid} moved between steps {s0} and {s1}"
                assert s1 == s0 + 1, f"running seq {sid} skipped a step"
    assert preempted_at and moved > 0      # re-admission places a preempted sequence afresh


@pytest.mark.parametrize("T,D,n,length", [(2, 2, 8, 6), (3, 2, 7, 5), (2, 3, 9, 11), (3, 3, 3, 4), (3, 3, 10, 1)])
def test_equal_requests_spread_evenly_over_empty_ranks(T, D, n, length):
    eng = build(k=2, target_ranks=T, draft_ranks=D)
    add_requests(eng, [(i, length, 5) for i in range(1, n + 1)])
    step = eng.sched.schedule()
    assert len(step.seqs) == n
    t_load = [sum(s.num_tokens for s in seqs) for seqs in step.target_seqs]
    d_load = [sum(s.num_tokens for s in step.seqs if s.draft_rank == d) for d in range(D)]
    assert max(t_load) - min(t_load) <= length and max(d_load) - min(d_load) <= length
    assert sum(t_load) == sum(d_load) == n * length
    if n >= max(T, D):
        assert all(step.target_plans) and all(step.draft_plans)
    # round robin, since every load ties or trails by one request
    assert [s.target_rank for s in step.seqs] == [i % T for i in range(n)]
    assert [s.draft_rank for s in step.seqs] == [i % D for i in range(n)]


def test_placement_follows_token_load_not_request_count():
    eng = build(k=2, target_ranks=2, draft_ranks=2)
    eng.check_balance = True
    add_requests(eng, [(1, 30, 50), (2, 4, 50), (3, 4, 50), (4, 4, 50), (5, 4, 50)])
    eng.step()
    # 30 tokens on rank 0 outweigh four 4-token requests on rank 1
    assert [s.target_rank for s in eng.sched.running] == [0, 1, 1, 1, 1]
    assert [s.draft_rank for s in eng.sched.running] == [0, 1, 1, 1, 1]
    add_requests(eng, [(6, 4, 50)])
    eng.step()
    assert (eng.sched.running[-1].target_rank, eng.sched.running[-1].draft_rank) == (1, 1)   # 31 vs 20 tokens


def test_placement_prefers_a_target_pool_the_request_fits_in():
    eng = build(k=0, target_max_len=64, target_ranks=2, target_blocks=[3, 1000], draft_blocks=None)
    add_requests(eng, [(1, 20, 2)])       # 5 blocks: only rank 1 can hold it, though rank 0 is idle
    step = eng.sched.schedule()
    assert [s.target_rank for s in step.seqs] == [1] and step.target_plans[0] is None
    eng.sched.abort_all("test")
    eng = build(k=0, target_max_len=64, target_ranks=2, target_blocks=[3, 1000], draft_blocks=None)
    add_requests(eng, [(1, 8, 2)])        # 2 blocks: fits the least loaded rank 0
    assert [s.target_rank for s in eng.sched.schedule().seqs] == [0]


def test_preemption_under_pressure_on_one_rank_takes_only_that_ranks_sequences():
    # rank 0 is tight (one sequence at full length needs 16 blocks), rank 1 is ample
    eng = build(k=2, target_max_len=64, target_ranks=2, draft_ranks=2, target_blocks=[18, 1000])
    ref = add_requests(eng, KV_MANY)
    eng.run()        # the engine checks every step that each rank's victims are its newest sequences
    assert_matches_reference(eng, ref)
    assert eng.preemptions and all(p.target_rank == 0 for p in eng.preemptions)
    # the victims were not the newest running sequences overall: newer ones on rank 1 kept running
    assert any(p.newer_elsewhere for p in eng.preemptions)
    assert_every_rank_worked(eng)


def test_preemption_victim_is_the_newest_unscheduled_sequence_of_the_same_rank():
    # 4 blocks of 4 tokens per target rank; four 4-token requests, two per rank, all growing
    eng = build(k=0, target_max_len=64, target_ranks=2, target_blocks=4, draft_blocks=None)
    add_requests(eng, [(1, 4, 30), (2, 4, 30), (3, 4, 30), (4, 4, 30)])
    while not eng.preemptions:
        assert eng.step()
    assert not eng.finished
    # rank 0 holds 1 and 3, rank 1 holds 2 and 4: each rank gives up its own newest
    assert sorted((p.seq_id, p.target_rank) for p in eng.preemptions) == [(3, 0), (4, 1)]
    assert [(s.seq_id, s.target_rank) for s in eng.sched.running] == [(1, 0), (2, 1)]


def test_frees_reach_the_ranks_that_held_the_sequence():
    eng = build(k=2, target_max_len=128, target_ranks=3, draft_ranks=2)
    eng.keep_steps = True
    finished_in: list[list[Sequence]] = []

    def record(step):                       # runs after update: these finished in this very step
        finished_in.append([s for s in step.seqs if s.finished])
    eng.on_step = record
    ref = add_requests(eng, [(i, 3 + i % 5, 2 + (5 * i) % 23) for i in range(1, 19)])
    eng.run()
    assert_matches_reference(eng, ref)
    assert sum(map(len, finished_in)) == len(ref)
    free_only = 0
    for i, step in enumerate(eng.steps[:-1]):
        nxt = eng.steps[i + 1]
        for s in finished_in[i]:
            for r, plan in enumerate(nxt.target_plans):
                frees = plan.free_seq_ids if plan is not None else []
                assert (s.seq_id in frees) == (r == s.target_rank), (s.seq_id, r)
            for d, plan in enumerate(nxt.draft_plans):
                frees = plan.free_seq_ids if plan is not None else []
                assert (s.seq_id in frees) == (d == s.draft_rank), (s.seq_id, d)
        for plan in nxt.target_plans + nxt.draft_plans:
            if plan is not None and not plan.seq_ids:
                assert plan.free_seq_ids
                free_only += 1
    assert free_only > 0


def test_a_plan_may_carry_only_frees():
    eng = build(k=2, target_ranks=2, draft_ranks=2)
    eng.keep_steps = True
    add_requests(eng, [(1, 4, 30), (2, 4, 6)])     # 1 on ranks (0, 0), 2 on ranks (1, 1)
    eng.step()
    assert [(s.target_rank, s.draft_rank) for s in eng.steps[0].seqs] == [(0, 0), (1, 1)]
    while 2 not in eng.finished:
        eng.step()
    # the driver's mirror let go at once; the worker still holds it until its next plan
    assert not eng.sched.target_pools[1].has(2) and not eng.sched.draft_pools[1].has(2)
    assert 2 in eng.targets[1].cache and eng.targets[1].blocks.has(2) and eng.drafts[1].blocks.has(2)
    eng.step()
    step, results = eng.steps[-1], eng.results[-1]
    t1, d1 = step.target_plans[1], step.draft_plans[1]
    assert t1.seq_ids == [] and t1.free_seq_ids == [2] and step.target_seqs[1] == []
    assert d1.seq_ids == [] and d1.free_seq_ids == [2] and step.draft_seqs[1] == []
    assert step.target_plans[0].free_seq_ids == [] and step.draft_plans[0].free_seq_ids == []
    assert results[1] is not None and results[1].seq_ids == []
    # the workers applied them: rank 1 holds nothing, like its mirrors
    assert eng.targets[1].cache == {} and eng.drafts[1].cache == {}
    for w in (eng.targets[1], eng.drafts[1]):
        assert w.blocks.num_free_blocks == w.blocks.num_blocks
    # nothing left to free: the next step has no plan at all for rank 1
    eng.step()
    assert eng.steps[-1].target_plans[1] is None and eng.steps[-1].draft_plans[1] is None
    eng.run()


def test_update_takes_none_for_a_plan_without_sequences():
    eng = build(k=0, target_ranks=2, draft_blocks=None)
    add_requests(eng, [(1, 4, 30), (2, 4, 1)])
    eng.step()
    assert 2 in eng.finished and eng.finished[2].target_rank == 1
    step = eng.sched.schedule()
    assert step.target_plans[1].seq_ids == [] and step.target_plans[1].free_seq_ids == [2]
    results = eng.verify(step, eng.truth(step))
    out = eng.sched.update(step, [results[0], None])
    assert [s.seq_id for s, _ in out] == [1]


def test_frees_of_a_preempted_sequence_go_to_its_old_ranks():
    eng = build(k=0, target_max_len=64, target_ranks=2, target_blocks=4, draft_blocks=None)
    eng.keep_steps = True
    add_requests(eng, [(1, 4, 30), (2, 4, 30), (3, 4, 30), (4, 4, 30)])
    while not eng.preemptions:
        eng.step()
    step = eng.steps[-1]
    assert step.target_plans[0].free_seq_ids == [3] and step.target_plans[1].free_seq_ids == [4]
    assert 3 not in eng.targets[0].cache and 4 not in eng.targets[1].cache


def test_update_validates_every_rank_before_applying_any():
    eng = build(k=2, target_ranks=2, draft_ranks=2)
    add_requests(eng, [(1, 3, 10), (2, 3, 10), (3, 3, 10)])
    step = eng.sched.schedule()
    assert [p.seq_ids for p in step.target_plans] == [[1, 3], [2]]
    truth = eng.truth(step)
    eng.propose(step, truth)
    good = eng.verify(step, truth)
    snapshot = [(s.seq_id, list(s.tokens), s.target_computed, s.draft_computed, s.num_draft_tokens)
                for s in step.seqs]

    def unchanged():
        assert [(s.seq_id, list(s.tokens), s.target_computed, s.draft_computed, s.num_draft_tokens)
                for s in step.seqs] == snapshot
        assert eng.sched.stats.num_steps == 0 and eng.sched.stats.num_emitted_tokens == 0

    bad_ids = StepResult(step_id=step.step_id, seq_ids=[3], num_emitted=[1], token_ids=[0])
    too_many = StepResult(step_id=step.step_id, seq_ids=[2], num_emitted=[step.target_plans[1].proposal_lens[0] + 2],
                          token_ids=[0] * (step.target_plans[1].proposal_lens[0] + 2))
    for results, match in [([good[0], bad_ids], "batch"), ([good[0], None], "batch"), ([good[0]], "batch"),
                           ([good[0], too_many], "emitted"), ([None, good[1]], "batch")]:
        with pytest.raises(ValueError, match=match):
            eng.sched.update(step, results)
        unchanged()
    out = eng.sched.update(step, good)
    assert [s.seq_id for s, _ in out] == [1, 3, 2]


def test_pool_too_small_for_one_request_raises_with_several_ranks():
    eng = build(k=2, target_max_len=64, target_ranks=2, target_blocks=2)
    add_requests(eng, [(1, 9, 4)])
    with pytest.raises(RuntimeError, match="KV pool too small"):
        eng.sched.schedule()


def test_abort_all_frees_go_to_each_ranks_queue():
    eng = build(k=3, target_max_len=64, target_ranks=2, draft_ranks=3, target_blocks=18)
    add_requests(eng, KV_MANY)
    for _ in range(3):
        eng.step()
    running = [(s.seq_id, s.target_rank, s.draft_rank) for s in eng.sched.running]
    owed_t = [set(f) for f in eng._frees_t]
    owed_d = [set(f) for f in eng._frees_d]
    failed = eng.sched.abort_all("error")
    assert len(failed) == len(KV_MANY) - len(eng.finished)
    for pool in eng.sched.target_pools + eng.sched.draft_pools:
        assert pool.num_free_blocks == pool.num_blocks
    assert [sorted(f) for f in eng.sched._target_frees] == \
        [sorted(owed_t[r] | {sid for sid, t, _ in running if t == r}) for r in range(2)]
    assert [sorted(f) for f in eng.sched._draft_frees] == \
        [sorted(owed_d[d] | {sid for sid, _, dr in running if dr == d}) for d in range(3)]


def random_engine(rng: random.Random, ks: list[int]):
    """A fake engine over 1-3 target and draft ranks with random limits, pool sizes (from
    one sequence's worth to plenty), draft errors, shard counts and probabilities.
    Returns (engine, k, target_max_len)."""
    T, D = rng.randrange(1, 4), rng.randrange(1, 4)
    k = rng.choice(ks)
    block_size = rng.choice([1, 2, 4, 8])
    tml = rng.randrange(8, 64)
    dml = rng.choice([None, None, rng.randrange(4, tml + 8)])
    need = -(-(tml - 1) // block_size)                    # one sequence at full length
    tblocks = [rng.choice([need, need + 1, need + rng.randrange(0, 2 * need), 10 * need]) for _ in range(T)]
    dblocks = rng.choice([None, [rng.choice([1, rng.randrange(1, 2 * need + 2), 10 * need]) for _ in range(D)]])
    eng = build(k=k, target_max_len=tml, draft_max_len=dml, block_size=block_size, target_ranks=T, draft_ranks=D,
                target_blocks=tblocks, draft_blocks=dblocks, max_num_seqs=rng.randrange(1, 10),
                max_num_batched_tokens=rng.randrange(1, 150))
    wrong_mod = rng.randrange(1, 6)
    eng.draft_wrong = lambda sid, pos: (sid * 5 + pos * 3) % 7 < wrong_mod - 1
    eng.num_shards = rng.randrange(1, 4)
    eng.probs = rng.random() < 0.5
    return eng, k, tml


@pytest.mark.parametrize("scenario", range(30))
def test_random_scenarios_with_several_workers(scenario):
    rng = random.Random(5000 + scenario)
    eng, k, tml = random_engine(rng, [0, 1, 2, 3, 4])
    if rng.random() < 0.3:
        eng.shorten = lambda sid, pos, k_i: (3 * sid + pos) % (k_i + 1)
    stop_ids = rng.sample(range(V), rng.randrange(0, 4))
    max_seqs = eng.sched.config.max_num_seqs
    max_batched = eng.sched.config.max_num_batched_tokens
    admitted_now: set[int] = set()

    def check(step):
        assert len(step.seqs) <= max_seqs
        admitted = [i for i, s in enumerate(step.seqs) if s.seq_id in admitted_now]
        if admitted and (admitted[0] > 0 or len(admitted) > 1):
            assert sum(sum(p.num_new) for p in step.target_plans if p is not None) <= max_batched
        for s in step.seqs:
            assert s.step_k in (0, expected_k(eng.sched.config, k, s.num_tokens, s.remaining))
    eng.on_plan = check

    total = rng.randrange(1, 25)
    ref: dict[int, tuple[list[int], str]] = {}
    next_id = 1
    steps = 0
    while next_id <= total or eng.sched.has_work:
        while next_id <= total and (not eng.sched.has_work or rng.random() < 0.4):
            ref |= add_requests(eng, [(next_id, rng.randrange(1, tml), rng.randrange(1, 40))], stop_ids)
            next_id += 1
        admitted_now = {s.seq_id for s in eng.sched.waiting}
        assert eng.step()
        steps += 1
        assert steps < 5000
    assert_matches_reference(eng, ref)
    assert len(eng.finished) == total


@pytest.mark.parametrize("scenario", range(30))
def test_random_scenarios_with_worker_deaths(scenario):
    """Random arrivals, finishes and preemptions while draft and target workers die -- between
    steps or during their call, as Engine.step sees it -- and come back empty some steps later;
    now and then every target worker is down at once. A restarted fake worker holds nothing, so
    any plan that still trusts its old KV fails the num_computed check, and greedy outputs must
    not change at all."""
    rng = random.Random(9000 + scenario)
    eng, k, tml = random_engine(rng, [0, 1, 2, 3, 4, 4])
    sched = eng.sched
    T = len(sched.target_pools)
    stop_ids = rng.sample(range(V), rng.randrange(0, 4))
    p_kill = rng.uniform(0.03, 0.12)
    deaths = {"draft": 0, "target": 0}
    back_at: dict[tuple[str, int], int] = {}              # (kind, rank) -> tick it answers again
    tick = 0

    def went_down(kind: str, rank: int, for_ticks: int) -> None:
        deaths[kind] += 1
        back_at[(kind, rank)] = tick + for_ticks

    def plan_faults(step):
        assert all(s.step_k in (0, expected_k(sched.config, k, s.num_tokens, s.remaining)) for s in step.seqs)
        # a rank that is down gets no call at all: no sequences, no frees
        assert all(step.target_plans[r] is None for r in sched.targets_down)
        assert all(step.draft_plans[d] is None for d in sched.drafts_down)
        assert all(s.step_k == 0 for s in step.seqs if s.draft_rank in sched.drafts_down)
        # only a worker that is called can fail during the call
        for d, plan in enumerate(step.draft_plans):
            if plan is not None and rng.random() < p_kill:
                eng.fail_drafts.add(d)
                went_down("draft", d, rng.randrange(0, 6))
        for r, plan in enumerate(step.target_plans):
            if plan is not None and rng.random() < p_kill:
                eng.fail_targets.add(r)
                went_down("target", r, rng.randrange(0, 6))
    eng.on_plan = plan_faults

    total = rng.randrange(3, 25)
    ref: dict[int, tuple[list[int], str]] = {}
    next_id = 1
    while next_id <= total or sched.has_work:
        tick += 1
        assert tick < 5000
        while next_id <= total and (not sched.has_work or rng.random() < 0.4):
            ref |= add_requests(eng, [(next_id, rng.randrange(1, tml), rng.randrange(1, 40))], stop_ids)
            next_id += 1
        # Engine.poll_workers: a worker that answers again is taken back before scheduling
        for (kind, rank), t in list(back_at.items()):
            if tick >= t:
                (sched.draft_back if kind == "draft" else sched.target_back)(rank)
                del back_at[(kind, rank)]
        for d in range(sched.num_draft_ranks):
            if d not in sched.drafts_down and rng.random() < p_kill / 2:
                eng.kill_draft(d)
                went_down("draft", d, rng.randrange(0, 6))
        if rng.random() < 0.04:
            # an outage of every target worker for a few steps
            for r in set(range(T)) - sched.targets_down:
                eng.kill_target(r)
                went_down("target", r, rng.randrange(1, 5))
        for r in set(range(T)) - sched.targets_down:
            if rng.random() < p_kill / 2:
                eng.kill_target(r)
                went_down("target", r, rng.randrange(0, 6))
        sched.check_integrity()
        if len(sched.targets_down) == T:
            # the Engine waits for a target worker; meanwhile nothing is planned and nothing dropped
            waiting = list(sched.waiting)
            assert not eng.step()
            assert not sched.running and list(sched.waiting) == waiting
            continue
        assert eng.step()
        eng.fail_drafts.clear()
        eng.fail_targets.clear()
        for w in eng.targets + eng.drafts:
            w.blocks.check_integrity()
        # a requeued sequence keeps every token it emitted
        for s in sched.waiting:
            assert eng.outputs.get(s.seq_id, []) == s.output_tokens
    assert_matches_reference(eng, ref)
    assert len(eng.finished) == total
    assert len({s.request_id for s in eng.finished.values()}) == total
    assert sched.stats.num_draft_worker_failures == deaths["draft"]
    assert sched.stats.num_target_worker_failures == deaths["target"]


# -- bugs found while writing these tests ---------------------------------------------------------------

def test_self_preemption_on_a_small_pool_moves_to_a_pool_that_fits():
    # rank 0 holds 8 slots, rank 1 plenty: the request starts on the idle rank 0 (it fits) and outgrows it
    eng = build(k=0, target_max_len=64, target_ranks=2, target_blocks=[2, 1000], draft_blocks=None)
    ref = add_requests(eng, [(1, 5, 20)])
    eng.run()
    assert_matches_reference(eng, ref)


def test_preempted_sequences_of_several_ranks_requeue_oldest_first():
    eng = build(k=0, target_max_len=64, target_ranks=2, target_blocks=4, draft_blocks=None)
    add_requests(eng, [(1, 4, 30), (2, 4, 30), (3, 4, 30), (4, 4, 30)])
    while not eng.preemptions:
        eng.step()
    # running order was 1, 2, 3, 4; 3 and 4 were preempted: 3 is older and keeps its priority
    assert [s.seq_id for s in eng.sched.waiting] == [3, 4]


def test_update_rejects_a_malformed_result_before_applying_any():
    eng = build(k=0, target_ranks=2, draft_blocks=None)
    add_requests(eng, [(1, 3, 10), (2, 3, 10), (3, 3, 10)])
    step = eng.sched.schedule()
    good = StepResult(step_id=step.step_id, seq_ids=[1, 3], num_emitted=[1, 1], token_ids=[7, 7])
    bad = StepResult(step_id=step.step_id, seq_ids=[2], num_emitted=[], token_ids=[])   # num_emitted missing
    with pytest.raises(ValueError):
        eng.sched.update(step, [good, bad])
    assert [s.num_tokens for s in step.seqs] == [3, 3, 3]


def test_a_draft_worker_that_is_down_gets_no_plan_not_even_frees():
    # A sequence that finished (or was requeued) while its draft worker was down used to queue
    # a free for that worker; the next step then sent a frees-only plan to the dead worker, and
    # the Engine counted its failed call as a second failure.
    eng = build(k=2)
    ref = add_requests(eng, [(1, 4, 3), (2, 4, 30)])
    eng.step()
    eng.kill_draft(0)

    def no_draft_call(step):
        assert step.draft_plans == [None]
    eng.on_plan = no_draft_call
    while 1 not in eng.finished:
        eng.step()
    eng.step()                  # the free of sequence 1 would have gone out with this step
    eng.on_plan = None
    eng.sched.draft_back(0)
    eng.run()
    assert_matches_reference(eng, ref)
    assert eng.sched.stats.num_draft_worker_failures == 1


def test_adaptive_newcomers_into_an_empty_batch_follow_the_drafts_record():
    # With nothing running, newcomers used to get k whatever the draft had been doing; an
    # adaptive scheduler now asks its policy what a fresh sequence earns.
    eng = build(speculation_policy="adaptive")
    for _ in range(60):
        eng.sched.policy.observe(AcceptanceEstimate(), proposed=4, accepted=0)
    add_requests(eng, [(1, 12, 8), (2, 9, 8)])
    step = eng.sched.schedule()
    assert [s.step_k for s in step.seqs] == [0, 0]
    assert all(p is None for p in step.draft_plans)
    good = build(speculation_policy="adaptive")
    add_requests(good, [(1, 12, 8)])
    assert [s.step_k for s in good.sched.schedule().seqs] == [good.sched.policy.fresh_k(4)] != [0]


def test_adaptive_newcomers_arriving_together_are_valued_as_one_batch():
    # Speculation pays at batch 1 and not at 64 (50 us per scored token against a 1 ms
    # step): 64 requests arriving together into an empty batch start without proposals,
    # and the draft is not asked to prefill their prompts; one alone proposes.
    eng = build(speculation_policy="adaptive", max_num_seqs=64)
    cost = eng.sched.policy.cost
    cost.target.set_weights([1e-3, 0.0, 5e-5, 5e-5, 0.0, 0.0])
    cost.draft.set_weights([1e-4, 5e-5, 1e-5, 1e-5])
    cost.overhead.set_weights([0.0, 0.0])
    add_requests(eng, [(i, 6, 4) for i in range(1, 65)])
    step = eng.sched.schedule()
    assert len(step.seqs) == 64 and all(s.step_k == 0 for s in step.seqs)
    assert all(p is None for p in step.draft_plans)
    alone = build(speculation_policy="adaptive", max_num_seqs=64)
    alone.sched.policy.cost = cost
    add_requests(alone, [(1, 6, 4)])
    assert [s.step_k for s in alone.sched.schedule().seqs] == [alone.sched.policy.fresh_k(3)] != [0]


def test_disable_by_batch_size_holds_in_the_step_that_admits_the_batch():
    # Eight requests arriving together into an empty batch make a batch of eight: with the
    # rule at 4, nobody proposes and the draft is not called (it used to prefill every
    # prompt, because the rule was checked against the sequences already running: none).
    eng = build(disable_by_batch_size=4)
    ref = add_requests(eng, [(i, 10, 6) for i in range(1, 9)])
    plans = []
    eng.on_plan = plans.append
    eng.run()
    assert_matches_reference(eng, ref)
    assert len(plans[0].seqs) == 8 and all(s.step_k == 0 for s in plans[0].seqs)
    # The batch never drops below the rule (all finish together): the draft is never called.
    assert all(p is None for step in plans for p in step.draft_plans)
    # Below the rule, newcomers propose as before.
    small = build(disable_by_batch_size=4)
    add_requests(small, [(1, 10, 6), (2, 10, 6)])
    assert [s.step_k for s in small.sched.schedule().seqs] == [4, 4]


def test_the_policy_hears_how_much_the_draft_caught_up_on():
    # Plain for the first steps, then proposing: the first proposing step feeds the draft
    # the whole context it never saw (prompt and output so far), which the policy is told
    # apart from the one token a drafting sequence feeds it in a steady step.
    eng = build(speculation_policy="adaptive")
    pol = eng.sched.policy
    pol.fresh_k = lambda cap, num_seqs=1: 0
    calls, seen = [], []
    pol.choose = lambda caps, est, fed: [0] * len(caps) if len(calls) < 4 else list(caps)
    observe_step = pol.observe_step

    def record(num_seqs, fed, proposed, emitted, seconds, draft_catch_up=0, longest=None):
        calls.append((proposed, draft_catch_up))
        observe_step(num_seqs, fed, proposed, emitted, seconds, draft_catch_up)
    pol.observe_step = record
    eng.on_plan = lambda step: seen.append(step.seqs[0].num_tokens)
    ref = add_requests(eng, [(1, 10, 24)])
    eng.run()
    assert_matches_reference(eng, ref)
    first = next(i for i, (proposed, _) in enumerate(calls) if proposed)
    assert [c for _, c in calls[:first]] == [0] * first
    assert calls[first][1] == seen[first] - 1        # everything it skipped, less the steady token
    assert all(c <= 1 for _, c in calls[first + 1:])  # then one or two tokens per step
    assert len(calls) > first + 2


class FloorPolicy(FixedFloorPolicy):
    """A fixed floor, and every outcome it hears kept."""

    def __init__(self, k: int, floor: float) -> None:
        super().__init__(k, floor)
        self.reports: list[tuple[int, int, list[float] | None]] = []

    def observe(self, estimate, proposed, accepted, confidence=None):
        self.reports.append((proposed, accepted, confidence))
        super().observe(estimate, proposed, accepted, confidence)


def test_drafts_that_stop_early_keep_outputs_and_bookkeeping_exact():
    """The drafts get floors (sequences planned more than one proposal) and the reach map;
    where they stop, the driver counts what they cached from what they proposed, the
    policy hears each proposal's reported probability, and the stops are counted."""
    eng = build(k=4)
    pol = eng.sched.policy = FloorPolicy(4, floor=0.5)
    plans = []
    eng.on_plan = lambda step: plans.extend(p for p in step.draft_plans if p is not None and p.seq_ids)
    ref = add_requests(eng, MIXED)
    eng.run()
    assert_matches_reference(eng, ref)
    for plan in plans:
        if any(k > 1 for k in plan.proposal_lens):
            assert plan.min_reach == [0.5 if k > 1 else 0.0 for k in plan.proposal_lens]
            assert len(plan.reach_map) == 10
        else:    # one proposal each: nothing to stop
            assert plan.min_reach == [] and plan.reach_map == []
    planned = sum(sum(p.proposal_lens) for p in plans)
    plans = [p for p in plans if p.min_reach]
    # Nothing was reported before the first step: a calibrated draft's map.
    assert plans[0].reach_map == pytest.approx([(b + 0.5) / 10 for b in range(10)])
    assert plans[-1].reach_map != plans[0].reach_map
    reported = [r for r in pol.reports if r[2] is not None]
    assert len(reported) > 50 and all(len(conf) == n for n, _, conf in reported)
    # 0.9 x 0.9 stays above the floor, 0.3 does not: a draft stops at its first miss.
    assert all(conf[:-1] == [0.9] * (n - 1) for n, _, conf in reported)
    st = eng.sched.stats
    assert st.num_stopped_proposals > 0
    assert st.num_stopped_proposals == planned - st.num_draft_tokens
    assert pol.confidence.observations == len(reported)


def test_a_sequence_alone_proposes_past_k_and_a_batch_stays_within_it():
    """max_speculative_tokens: alone, a sequence plans up to 8 proposals with floors (its
    draft stops where they stop paying) and 8 lookahead slots are reserved for it; once a
    second sequence runs, both stay within num_speculative_tokens (the step admitting it
    keeps the plan made for the first alone; the newcomer gets at most k). Outputs stay
    exact."""
    eng = build(k=4, speculation_policy="adaptive", max_speculative_tokens=8)
    assert eng.sched.k == 8
    cost = eng.sched.policy.cost
    cost.target.set_weights([1e-3, 0.0, 1e-5, 1e-5, 0.0, 0.0])
    cost.draft.set_weights([1e-4, 1e-5, 1e-5, 1e-5])
    cost.overhead.set_weights([0.0, 0.0])
    plans = []
    eng.on_plan = lambda step: plans.append([p for p in step.draft_plans if p is not None and p.seq_ids])
    ref = add_requests(eng, [(1, 10, 120)])
    for _ in range(8):
        eng.step()
    alone = [p for ps in plans[1:] for p in ps]
    assert alone and all(p.k == 8 and p.proposal_lens == [8] and p.min_reach[0] > 0 for p in alone)
    ref.update(add_requests(eng, [(2, 6, 40)]))
    plans.clear()
    eng.run()
    assert_matches_reference(eng, ref)
    together = [p for ps in plans for p in ps if p.num_seqs == 2]
    assert together[0].proposal_lens == [8, 4]
    assert len(together) > 3 and all(p.k <= 4 and not p.min_reach for p in together[1:])
    # The first sequence outlives the second: alone again, it reaches past k again.
    assert any(p.k > 4 for ps in plans[-5:] for p in ps)
    assert eng.sched.stats.num_stopped_proposals > 0


def test_a_static_policy_never_asks_drafts_to_stop():
    eng = build(k=4)
    plans = []
    eng.on_plan = lambda step: plans.extend(p for p in step.draft_plans if p is not None and p.seq_ids)
    add_requests(eng, MIXED[:6])
    eng.run()
    assert plans and all(not p.min_reach and not p.reach_map for p in plans)
    assert eng.sched.stats.num_stopped_proposals == 0
