"""Scheduler, driven by a pure-Python stand-in for the draft and target workers.

The "model" is a deterministic function of the token history; the draft proposes the same
function but is wrong at positions chosen by ``draft_wrong``. Each fake worker keeps what a
real worker keeps -- per sequence, the tokens in its KV cache and a BlockManager resized the
way ``workers/kv_cache.py`` resizes it -- and asserts the ``num_computed`` invariant on every
plan: ``num_computed`` is exactly the length of the cached prefix that matches the
sequence's true tokens (nothing stale is trusted, nothing valid is recomputed), and the fed
tokens complete it to exactly the sequence's current length.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Callable

import pytest

from scheduler.block_manager import BlockManager
from scheduler.merge import merge_proposals
from scheduler.messages import Proposals, StepPlan, StepResult, decode, encode
from scheduler.sampling_params import SamplingParams
from scheduler.scheduler import ScheduledStep, Scheduler, SchedulerConfig
from scheduler.sequence import Sequence, SequenceStatus

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

    def apply(self, plan: StepPlan, truth: dict[int, list[int]]) -> list[list[int]]:
        """Frees, then per sequence: check and truncate the cache to num_computed, feed the
        new tokens, resize the block mirror. Returns each sequence's history after feeding."""
        for sid in plan.free_seq_ids:
            self.cache.pop(sid, None)
            self.blocks.free(sid)
        histories = []
        pos = 0
        for i, sid in enumerate(plan.seq_ids):
            c, m, slots = plan.num_computed[i], plan.num_new[i], plan.num_slots[i]
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
class Engine:
    """schedule -> draft -> merge -> verify -> update, with the fake workers."""
    sched: Scheduler
    target: FakeWorker
    draft: FakeWorker | None
    draft_wrong: Callable[[int, int], bool] = default_wrong
    num_shards: int = 2
    # how many of its planned k_i tokens the proposer actually proposes (n-gram style)
    shorten: Callable[[int, int, int], int] | None = None
    counts: Counts = field(default_factory=Counts)
    finished: dict[int, Sequence] = field(default_factory=dict)
    outputs: dict[int, list[int]] = field(default_factory=dict)
    steps: list[ScheduledStep] = field(default_factory=list)     # kept when keep_steps
    results: list[StepResult] = field(default_factory=list)
    on_step: Callable[[ScheduledStep], None] | None = None
    on_plan: Callable[[ScheduledStep], None] | None = None
    keep_steps: bool = False

    def truth(self, step: ScheduledStep) -> dict[int, list[int]]:
        return {s.seq_id: list(s.tokens) for s in step.seqs}

    def step(self) -> bool:
        sched = self.sched
        before_running = list(sched.running)
        before_waiting = {s.seq_id for s in sched.waiting}
        step = sched.schedule()
        sched.check_integrity()
        if step is None:
            return False
        self.check_plan_shape(step, before_running, before_waiting)
        if self.on_plan is not None:
            self.on_plan(step)
        truth = self.truth(step)
        if step.draft is not None:
            self.propose(step, truth)
        result = self.verify(step, truth)
        self.check_mirrors(step)
        out = sched.update(step, result)
        sched.check_integrity()
        for seq, appended in out:
            self.outputs.setdefault(seq.seq_id, []).extend(appended)
            assert self.outputs[seq.seq_id] == seq.output_tokens
            if seq.finished:
                assert seq.seq_id not in self.finished, "a request finished twice"
                self.finished[seq.seq_id] = seq
        if self.on_step is not None:
            self.on_step(step)
        if self.keep_steps:
            self.steps.append(step)
            self.results.append(result)
        return True

    def check_plan_shape(self, step: ScheduledStep, before_running: list[Sequence], before_waiting: set[int]) -> None:
        t = step.target
        ids = [s.seq_id for s in step.seqs]
        assert t.seq_ids == ids
        kept = [s for s in step.seqs if s.seq_id not in before_waiting]
        # running sequences keep their order; the ones left out are the newest (preempted)
        assert kept == before_running[:len(kept)]
        for s in before_running[len(kept):]:
            assert s.status is SequenceStatus.WAITING and s.target_computed == 0 and s.draft_computed == 0
            assert not self.sched.target_blocks.has(s.seq_id)
        for i, s in enumerate(step.seqs):
            n = s.num_tokens
            assert s.seq_id not in self.finished and s.status is SequenceStatus.RUNNING
            assert t.num_computed[i] == s.target_computed
            assert t.num_new[i] == n - s.target_computed >= 1
            assert t.num_slots[i] == n + s.step_k
            assert t.proposal_lens[i] == s.step_k
        if step.draft is None:
            assert all(s.step_k == 0 for s in step.seqs)
        else:
            d = step.draft
            assert d.k == t.k
            assert step.draft_seqs == [s for s in step.seqs if s.step_k > 0]
            assert d.seq_ids == [s.seq_id for s in step.draft_seqs]
            for i, s in enumerate(step.draft_seqs):
                assert d.num_computed[i] == s.draft_computed
                assert d.num_slots[i] == s.num_tokens + s.step_k - 1
                assert d.proposal_lens[i] == s.step_k

    def check_mirrors(self, step: ScheduledStep) -> None:
        """Once a worker has applied the step's plan it has seen exactly the operations the
        driver's mirror has: the same blocks per sequence and the same free count."""
        sched = self.sched
        running = {s.seq_id for s in sched.running}
        pairs = [(sched.target_blocks, self.target)]
        if sched.draft_blocks is not None:
            pairs.append((sched.draft_blocks, self.draft))
        for mirror, worker in pairs:
            assert set(mirror._tables) <= running, "a sequence that is not running holds blocks"
            assert mirror.num_free_blocks == worker.blocks.num_free_blocks
            for sid in set(mirror._tables) | set(worker.blocks._tables):
                assert len(mirror.block_table(sid)) == len(worker.blocks.block_table(sid))

    def propose(self, step: ScheduledStep, truth: dict[int, list[int]]) -> None:
        plan = roundtrip(step.draft)
        k = plan.k
        assert self.draft is not None or plan.num_seqs == 0
        histories = self.draft.apply(plan, truth) if self.draft is not None else []
        rows = []
        for i, sid in enumerate(plan.seq_ids):
            k_i = plan.proposal_lens[i]
            if self.shorten is not None:
                k_i = self.shorten(sid, len(histories[i]), k_i)
                assert 0 <= k_i <= plan.proposal_lens[i]
            hist = histories[i]
            props = []
            for _ in range(k_i):
                t = true_next(hist + props)
                if self.draft_wrong(sid, len(hist) + len(props)):
                    t = (t + 1) % V
                props.append(t)
            # the draft ran its first k_i - 1 proposals through the model: they are in its KV
            self.draft.cache[sid].extend(props[:k_i - 1])
            assert len(self.draft.cache[sid]) <= self.draft.blocks.num_slots(sid)
            rows.append((sid, props))
        if plan.num_seqs:
            self.counts.draft_calls += 1
        # several shards, in scrambled order
        shards = []
        for j in range(self.num_shards):
            part = rows[j::self.num_shards]
            toks = [t for _, p in part for t in p + [-1] * (k - len(p))]
            shards.append(Proposals(step_id=plan.step_id, k=k, has_probs=False, seq_ids=[s for s, _ in part],
                                    proposal_lens=[len(p) for _, p in part], token_ids=toks))
        shards = [decode(encode(s), expected=Proposals) for s in reversed(shards)]
        merged = merge_proposals(step.target.seq_ids, step.target.k, shards)
        assert merged.draft_rows == [-1] * step.target.num_seqs
        self.sched.attach_proposals(step, merged)

    def verify(self, step: ScheduledStep, truth: dict[int, list[int]]) -> StepResult:
        plan = roundtrip(step.target)
        k = plan.k
        histories = self.target.apply(plan, truth)
        num_emitted, token_ids = [], []
        for i, sid in enumerate(plan.seq_ids):
            k_i = plan.proposal_lens[i] if plan.proposal_token_ids else 0
            props = plan.proposal_token_ids[i * k:i * k + k_i]
            assert -1 not in props
            if plan.proposal_token_ids:
                assert plan.proposal_token_ids[i * k + k_i:(i + 1) * k] == [-1] * (k - k_i)
            self.target.cache[sid].extend(props)
            assert len(self.target.cache[sid]) <= self.target.blocks.num_slots(sid)
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
        self.counts.steps += 1
        result = StepResult(step_id=plan.step_id, seq_ids=list(plan.seq_ids), num_emitted=num_emitted,
                            token_ids=token_ids)
        return decode(encode(result), expected=StepResult)

    def run(self, max_steps: int = 10_000) -> None:
        for _ in range(max_steps):
            if not self.sched.has_work:
                return
            assert self.step(), "scheduler has work but scheduled nothing"
        raise AssertionError("did not finish")


def build(k: int = 4, target_max_len: int = 256, draft_max_len: int | None = None, block_size: int = 4,
          target_blocks: int = 1000, draft_blocks: int | None = 1000, **cfg) -> Engine:
    """A scheduler with ample pools by default; ``draft_blocks=None``: a proposer without a
    KV pool (n-gram style). The fake workers' pools are the same size as the mirrors."""
    config = SchedulerConfig(num_speculative_tokens=k, target_max_len=target_max_len, draft_max_len=draft_max_len,
                             **cfg)
    dpool = BlockManager(draft_blocks, block_size) if draft_blocks else None
    sched = Scheduler(config, BlockManager(target_blocks, block_size), dpool)
    target = FakeWorker("target", target_blocks, block_size)
    draft = FakeWorker("draft", draft_blocks or 2000, block_size)
    return Engine(sched, target, draft)


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
    assert s.target_blocks.num_free_blocks == s.target_blocks.num_blocks
    if s.draft_blocks is not None:
        assert s.draft_blocks.num_free_blocks == s.draft_blocks.num_blocks


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
    eng.draft = FakeWorker("draft", 2000, 4)
    ref = add_requests(eng, MIXED[:10])
    eng.run()
    assert_matches_reference(eng, ref)
    assert eng.counts.accepted > 0


@pytest.mark.parametrize("with_pool", [True, False])
def test_proposer_may_propose_fewer_than_planned(with_pool):
    eng = build(k=4, draft_blocks=1000 if with_pool else None)
    if not with_pool:
        eng.draft = FakeWorker("draft", 2000, 4)
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
        ids = nxt.target.seq_ids
        assert ids[-1] == sid              # joins at the end of the batch ...
        assert len(ids) > 1                # ... next to sequences already running
        assert nxt.target.num_computed[-1] == 0 and nxt.target.num_new[-1] == len(prompt_for(sid, 1 + sid % 6))
    assert max(len(s.seqs) for s in eng.steps) >= 5


def test_max_num_seqs_and_token_budget_limit_admission():
    eng = build(k=2, max_num_seqs=3, max_num_batched_tokens=20)
    eng.keep_steps = True
    ref = add_requests(eng, [(i, 8, 6) for i in range(1, 9)])
    eng.run()
    assert_matches_reference(eng, ref)
    assert max(len(s.seqs) for s in eng.steps) == 3
    # first step: two 8-token prompts fit the 20-token budget, a third does not
    assert eng.steps[0].target.seq_ids == [1, 2]
    for s in eng.steps:
        assert sum(s.target.num_new) <= 20


def test_a_single_prompt_over_the_token_budget_still_runs_alone():
    eng = build(k=2, max_num_batched_tokens=4)
    eng.keep_steps = True
    ref = add_requests(eng, [(1, 10, 3), (2, 10, 3)])
    eng.run()
    assert_matches_reference(eng, ref)
    assert eng.steps[0].target.seq_ids == [1]


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
        if s.draft is not None:
            assert all(slots <= 24 - 1 for slots in s.draft.num_slots)   # n + k_i - 1


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
    st, res = eng.steps[stop_step], eng.results[stop_step]
    i = st.target.seq_ids.index(sid)
    assert res.num_emitted[i] == 5
    emitted = res.token_ids[sum(res.num_emitted[:i]):sum(res.num_emitted[:i + 1])]
    assert emitted == out[5 * stop_step:5 * stop_step + 5]
    assert seq.output_tokens == out[:5 * stop_step] + emitted[:index % 5 + 1]
    # from the next step on it is gone, and the workers were told to free it
    later = eng.steps[stop_step + 1]
    assert sid not in later.target.seq_ids
    assert sid in later.target.free_seq_ids
    assert later.draft is not None and sid in later.draft.free_seq_ids
    assert sid not in eng.target.cache and sid not in eng.draft.cache
    assert not eng.sched.target_blocks.has(sid)


def test_update_returns_only_tokens_up_to_the_stop():
    sid, out = find_seq_with_fresh_token_at(1)
    eng = build(k=4)
    eng.draft_wrong = lambda s, p: False
    eng.sched.add(make_seq(sid, prompt_for(sid, 4), 50, stop_ids=[out[1]]))
    step = eng.sched.schedule()
    truth = eng.truth(step)
    eng.propose(step, truth)
    result = eng.verify(step, truth)
    assert result.num_emitted == [5]
    [(seq, appended)] = eng.sched.update(step, result)
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
        eng.sched.update(step, StepResult(step_id=step.step_id, seq_ids=[2, 1], num_emitted=[1, 1], token_ids=[0, 0]))
    # no proposals attached: the plan's proposal_lens are the planned k_i = 2, so 4 emitted is too many
    with pytest.raises(ValueError, match="accepted"):
        eng.sched.update(step, StepResult(step_id=step.step_id, seq_ids=[1, 2], num_emitted=[4, 1],
                                          token_ids=[0] * 5))


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
            assert sum(step.target.num_new) <= max_batched
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
    for plan in (step.target, step.draft):
        plan = roundtrip(plan)
        assert plan.seq_ids == [9, 10]
        assert plan.temperature == [0.8, 0.0] and plan.top_k == [7, 0] and plan.top_p == [0.5, 1.0]
        assert plan.seeds == [2**63 - 1, 10]
    assert step.target.token_ids == [1, 2, 3, 4, 5] and step.target.num_new == [3, 2]
    assert step.target.num_slots == [5, 4] and step.draft.num_slots == [4, 3]


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
    assert eng.sched.target_blocks.num_free_blocks == eng.sched.target_blocks.num_blocks
    assert eng.sched.draft_blocks.num_free_blocks == eng.sched.draft_blocks.num_blocks
    assert sorted(eng.sched._target_frees) == sorted(running)
    eng.sched.check_integrity()
