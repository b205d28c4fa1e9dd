"""Hostile step messages at the workers: seeded random bytes, byte-mutated encodings and
decode-valid plans with one field made hostile go through ``decode`` into a real tiny
draft and target worker, between the steps of a real speculative generation.

Only the documented errors may escape: ProtocolError and PlanError (ValueErrors),
StaleCacheError (the runtime reads it as "this worker restarted") and the pool's "out of
blocks" RuntimeError. A refused plan leaves block tables, written counts and K/V exactly
as they were, and the generation the fuzz runs between ends exactly as transformers'
greedy decoding (and a seeded sampled request as the same run without fuzzing): the
workers kept serving.
"""

from __future__ import annotations

import random
import re
from collections import Counter

import pytest
import torch
from transformers import AutoModelForCausalLM

from specray.runtime.engine.core import Engine
from specray.runtime.transport.draft_proposer import DraftModelProposer
from specray.runtime.transport.worker_call import LocalCall
from specray.scheduler.block_manager import BlockManager
from specray.scheduler.config import CacheConfig, SpeculationConfig
from specray.scheduler.messages import Proposals, ProtocolError, StepPlan, StepResult, decode, encode
from specray.scheduler.sampling_params import SamplingParams
from specray.scheduler.scheduler import Scheduler
from specray.scheduler.sequence import Sequence
from specray.workers.config import ModelConfig
from specray.workers.draft_worker import DraftWorker
from specray.workers.errors import PlanError, StaleCacheError
from specray.workers.model_files import settle_windows
from specray.workers.target_worker import TargetWorker

VOCAB = 96
K = 3
BLOCK = 4
MAX_LEN = 48
MAX_SEQS = 16
WORKER_BLOCKS = 128
MIRROR_BLOCKS = 24          # the driver's view: small enough that the real run preempts
CASES_PER_GAP = 150
REAL = {0: 9, 1: 5, 2: 12, 3: 7}                     # seq_id: prompt length
SAMPLED = 3                                          # a seeded sampled request
MAX_TOKENS = 22
SCRATCH = (1000, 1001, 1002)                          # the fuzz's own sequences
KEEP = set(REAL) | set(SCRATCH)

OUT_OF_BLOCKS = "out of blocks"


@pytest.fixture(autouse=True)
def one_thread():
    """Thousands of tiny forwards: a second thread only adds synchronisation, which on a
    busy machine costs more than the matmuls themselves."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def paths(tiny_model, tmp_path_factory):
    """(draft, target): the draft is the target with noise added, so it agrees with the
    target often but not always (full acceptance, catch-up and rollback all happen)."""
    target = tiny_model("llama", seed=51)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    g = torch.Generator().manual_seed(52)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.02)
    draft = tmp_path_factory.mktemp("noisy_draft")
    model.save_pretrained(draft)
    return str(draft), target


def make_workers(paths):
    model = settle_windows(ModelConfig(target=paths[1], draft=paths[0], dtype="float32", device="cpu",
                                       max_model_len=MAX_LEN))
    cache = CacheConfig(block_size=BLOCK, num_kv_blocks=WORKER_BLOCKS, max_num_seqs=MAX_SEQS)
    return DraftWorker(model, cache), TargetWorker(model, cache)


def prompts():
    g = torch.Generator().manual_seed(53)
    return {sid: torch.randint(0, VOCAB, (n,), generator=g).tolist() for sid, n in REAL.items()}


def generate(draft, target, between=lambda where: None) -> dict[int, list[int]]:
    """The real engine's step loop over in-process workers, every message through the codec."""
    sched = Scheduler(CacheConfig(block_size=BLOCK, max_num_seqs=MAX_SEQS), SpeculationConfig(num_speculative_tokens=K),
                      MAX_LEN, BlockManager(MIRROR_BLOCKS, BLOCK), BlockManager(MIRROR_BLOCKS, BLOCK),
                      draft_max_model_len=128)

    def propose(plan):
        props, probs = draft.propose(decode(encode(plan), StepPlan))
        return decode(encode(props), Proposals), probs

    def verify(plan, probs):
        between("in flight")
        return decode(encode(target.verify(decode(encode(plan), StepPlan), *probs)), StepResult)

    engine = Engine(sched, [LocalCall(verify)], DraftModelProposer([LocalCall(propose)]))
    seqs = []
    for sid, toks in prompts().items():
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.9 if sid == SAMPLED else 0.0, top_k=20)
        seqs.append(Sequence(seq_id=sid, request_id=str(sid), prompt_len=len(toks), tokens=list(toks),
                             params=params, seed=4321 + sid))
        sched.add(seqs[-1])
    while sched.has_work:
        assert engine.step()
        between("between steps")
    assert sched.stats.num_preemptions > 0                 # the recompute path ran too
    return {s.seq_id: s.output_tokens for s in seqs}


# -- the fuzz -----------------------------------------------------------------------------

def allowed(e: BaseException) -> bool:
    if isinstance(e, (ProtocolError, PlanError, StaleCacheError)):
        return True
    return type(e) is RuntimeError and OUT_OF_BLOCKS in str(e)


def state(worker):
    kv = worker.runner.kv
    # Private fields on purpose: "unchanged" means every table, the free list's order and
    # the written counts, not just the public counters.
    return ({s: list(t) for s, t in kv.blocks._tables.items()}, list(kv.blocks._free), dict(kv.num_written))


def kv_tensors(worker):
    return [t.clone() for layer in worker.runner.kv.layers for t in layer]


class Fuzzer:
    def __init__(self, draft, target, seed: int) -> None:
        self.workers = {"draft": draft, "target": target}
        self.rng = random.Random(seed)
        self.gen = torch.Generator().manual_seed(seed)      # draft probabilities, reproducible too
        self.counts: Counter = Counter()

    # -- running one case ---------------------------------------------------------------
    def call(self, role, plan, shards):
        w = self.workers[role]
        if role == "draft":
            props, probs = w.propose(plan)
            decode(encode(props), Proposals)              # what the actor sends, what the driver reads
            if probs is not None:
                assert probs.shape == (plan.num_seqs, plan.width, VOCAB)
        else:
            res = w.verify(plan, *shards)
            res = decode(encode(res), StepResult)
            assert res.seq_ids == plan.seq_ids
            assert all(0 <= t < VOCAB for t in res.token_ids)

    def feed(self, role, message, shards=(), expect=None) -> None:
        """message: bytes (decoded here) or a StepPlan (an in-process call). expect: None
        (any allowed outcome), "ok", or the exception class the case must raise."""
        w = self.workers[role]
        before, tensors = state(w), kv_tensors(w)
        try:
            plan = decode(message, StepPlan) if isinstance(message, bytes) else message
            self.call(role, plan, shards)
        except Exception as e:  # everything that escapes is judged below
            assert allowed(e), f"{role}: {type(e).__name__}: {e}"
            # Exact types: a StaleCacheError is a RuntimeError, but means something else.
            assert expect is None or type(e) in (expect if isinstance(expect, tuple) else (expect,)), \
                f"{role}: expected {expect!r}, got {type(e).__name__}: {e}"
            assert state(w) == before, f"{role}: refused plan changed the pool ({e})"
            assert all(torch.equal(a, b) for a, b in zip(tensors, kv_tensors(w)))
            self.counts[type(e).__name__ + (" (pool)" if type(e) is RuntimeError else "")] += 1
            return
        assert expect in (None, "ok"), f"{role}: expected {expect!r}, the plan was accepted"
        self.counts["accepted"] += 1
        w.runner.kv.blocks.check_integrity()
        # Sequences a mutated plan invented are dropped (a valid free-only plan), so the
        # fuzz never takes the blocks the driver's mirror counts on.
        extra = [s for s in w.runner.kv.blocks._tables if s not in KEEP]
        if extra:
            self.call(role, decode(encode(StepPlan(step_id=0, width=K, free_seq_ids=extra)), StepPlan), ())

    def run(self, n: int) -> None:
        for _ in range(n):
            self.one()

    def one(self) -> None:
        rng = self.rng
        role = rng.choice(("draft", "target"))
        roll = rng.random()
        self.counts["cases"] += 1
        if roll < 0.1:
            self.feed(role, rng.randbytes(rng.randrange(0, 120)))
        elif roll < 0.2:
            self.feed(role, *self.structured())
        elif roll < 0.5:
            plan, shards = self.template(role)
            data = bytearray(encode(plan))
            for _ in range(rng.randint(1, 4)):
                data[rng.randrange(len(data))] = rng.getrandbits(8)
            self.feed(role, bytes(data), shards)
        elif roll < 0.58:
            plan, shards = self.template(role)
            self.feed(role, encode(plan), shards, expect="ok")      # control: valid plans still pass
        else:
            plan, shards = self.template(role)
            name, mutate = rng.choice(MUTATIONS)
            out = mutate(self, role, plan, shards)
            if out is None:                                          # not applicable to this plan
                self.counts["skipped"] += 1
                return
            plan, shards, expect, in_process = out
            self.counts["mut:" + name] += 1
            self.feed(role, plan if in_process else encode(plan), shards, expect)

    # -- inputs ---------------------------------------------------------------------------
    def structured(self):
        """A well-formed StepPlan with random fields of consistent lengths (and maybe a
        probability shard): much of it decodes, and then only the worker can refuse it."""
        rng = self.rng
        n, k = rng.randint(0, 3), rng.randint(0, K)
        per_seq = lambda make: [make() for _ in range(n)]  # noqa: E731
        plan = StepPlan(step_id=rng.getrandbits(32), width=k)
        plan.seq_ids = per_seq(lambda: rng.choice(SCRATCH + (rng.getrandbits(63),)))
        plan.num_computed = per_seq(lambda: rng.choice((0, rng.randint(0, 40), rng.getrandbits(31))))
        plan.num_new = per_seq(lambda: rng.randint(0, 3))
        plan.token_ids = [rng.randint(-2, VOCAB + 2) for _ in range(sum(plan.num_new))]
        plan.num_slots = [min(c + f + rng.choice((0, 1, 5, 60)), 2**31 - 1)
                          for c, f in zip(plan.num_computed, plan.num_new)]
        plan.proposal_lens = per_seq(lambda: rng.randint(0, k))
        if rng.random() < 0.5:
            plan.proposal_token_ids = [rng.randint(-3, VOCAB + 1) for _ in range(n * k)]
            plan.draft_rows = per_seq(lambda: rng.randint(-1, 2))
        plan.temperature = per_seq(lambda: rng.choice((0.0, 0.7)))
        plan.top_k = per_seq(lambda: rng.randint(0, 5))
        plan.top_p = [1.0] * n
        plan.seeds = per_seq(lambda: rng.getrandbits(63))
        plan.free_seq_ids = [rng.choice(SCRATCH + (7777,)) for _ in range(rng.randint(0, 2))]
        shards = (torch.softmax(torch.randn(2, k, VOCAB, generator=self.gen), dim=-1),) if rng.random() < 0.5 else ()
        return encode(plan), shards

    def template(self, role):
        """A valid plan over the scratch sequences, built from the worker's current state
        (and, for the target, the draft probabilities it needs)."""
        rng = self.rng
        kv = self.workers[role].runner.kv
        sids = rng.sample(SCRATCH, rng.randint(1, len(SCRATCH)))
        frees = [s for s in SCRATCH if s not in sids and rng.random() < 0.2]
        frees += [rng.choice((5555, 2**62))] * (rng.random() < 0.2)
        with_props = role == "target" and rng.random() < 0.8
        plan = StepPlan(step_id=rng.randrange(1 << 20), width=K, free_seq_ids=frees)
        rows = 0
        for sid in sids:
            k_i = rng.randint(0, K)
            look = max(k_i - 1, 0) if role == "draft" else (k_i if with_props else 0)
            new = rng.randint(1, 4)
            computed = min(rng.randint(0, kv.num_written.get(sid, 0)), MAX_LEN - look - new)
            sampled = rng.random() < 0.4
            plan.seq_ids.append(sid)
            plan.num_computed.append(computed)
            plan.num_new.append(new)
            plan.token_ids.extend(rng.randrange(VOCAB) for _ in range(new))
            plan.num_slots.append(min(computed + new + look + rng.randint(0, 2), MAX_LEN))
            plan.proposal_lens.append(k_i)
            plan.temperature.append(rng.choice((0.7, 1.2)) if sampled else 0.0)
            plan.top_k.append(rng.choice((0, 5)))
            plan.top_p.append(rng.choice((1.0, 0.9)))
            plan.seeds.append(rng.getrandbits(63))
            if with_props:
                plan.proposal_token_ids.extend([rng.randrange(VOCAB) for _ in range(k_i)] + [-1] * (K - k_i))
                has_row = sampled and k_i and rng.random() < 0.7
                plan.draft_rows.append(rows if has_row else -1)
                rows += bool(has_row)
        shards = ()
        if rows:
            extra = rng.randint(0, 2)
            q = torch.softmax(torch.randn(rows + extra, K, VOCAB, generator=self.gen), dim=-1)
            shards = (q,) if rng.random() < 0.5 else (None, q[:1], None, q[1:])
        plan.validate()
        return plan, shards


# -- field mutations: (plan, shards, expect, in_process) or None where not applicable ---------

def _pick(f, plan, pred=lambda i: True):
    idx = [i for i in range(plan.num_seqs) if pred(i)]
    return f.rng.choice(idx) if idx else None


def _held(f, role, plan, sid):
    return 0 if sid in plan.free_seq_ids else len(f.workers[role].runner.kv.blocks.block_table(sid)) * BLOCK


def _lookahead(role, plan, i):
    if role == "draft":
        return max(plan.proposal_lens[i] - 1, 0)
    return plan.proposal_lens[i] if plan.proposal_token_ids else 0


def mut_dup_seq(f, role, plan, shards):
    if plan.num_seqs < 2:
        return None
    plan.seq_ids[1] = plan.seq_ids[0]
    return plan, shards, ProtocolError, False


def mut_unknown_seq(f, role, plan, shards):
    """A sequence this worker does not hold, with cached tokens: what a restart looks like."""
    i = f.rng.randrange(plan.num_seqs)
    plan.seq_ids[i] = 4000 + f.rng.randrange(1000)
    plan.num_computed[i] = c = f.rng.randint(1, 20)
    plan.num_slots[i] = min(max(plan.num_slots[i], c + plan.num_new[i] + _lookahead(role, plan, i)), MAX_LEN)
    if plan.num_slots[i] < c + plan.num_new[i] + _lookahead(role, plan, i):
        return None
    return plan, shards, StaleCacheError, False


def mut_beyond_slots(f, role, plan, shards):
    i = f.rng.randrange(plan.num_seqs)
    c = _held(f, role, plan, plan.seq_ids[i]) + f.rng.randint(1, 8)
    plan.num_computed[i] = c
    plan.num_slots[i] = max(plan.num_slots[i], c + plan.num_new[i] + _lookahead(role, plan, i))
    # Freed by this plan, or past max_model_len: a PlanError; otherwise a stale cache.
    return plan, shards, (PlanError, StaleCacheError), False


def mut_beyond_written(f, role, plan, shards):
    kv = f.workers[role].runner.kv
    i = _pick(f, plan, lambda i: plan.seq_ids[i] not in plan.free_seq_ids
              and kv.num_written.get(plan.seq_ids[i], 0) < len(kv.blocks.block_table(plan.seq_ids[i])) * BLOCK)
    if i is None:
        return None
    plan.num_computed[i] = c = kv.num_written[plan.seq_ids[i]] + 1
    plan.num_slots[i] = max(plan.num_slots[i], c + plan.num_new[i] + _lookahead(role, plan, i))
    return plan, shards, PlanError, False


def mut_short_slots(f, role, plan, shards):
    i = _pick(f, plan, lambda i: _lookahead(role, plan, i) > 0)
    if i is None:
        return None
    plan.num_slots[i] = plan.num_computed[i] + plan.num_new[i] + _lookahead(role, plan, i) - 1
    return plan, shards, PlanError, False


def mut_slots_over_len(f, role, plan, shards):
    i = f.rng.randrange(plan.num_seqs)
    plan.num_slots[i] = f.rng.choice((MAX_LEN + 1, 10_000, 2**31 - 1))
    return plan, shards, PlanError, False


def _hogs(f, plan, n):
    for j in range(n):
        plan.seq_ids.append(3000 + j)
        plan.num_computed.append(0)
        plan.num_new.append(1)
        plan.token_ids.append(f.rng.randrange(VOCAB))
        plan.num_slots.append(MAX_LEN)
        plan.proposal_lens.append(0)
        plan.temperature.append(0.0)
        plan.top_k.append(0)
        plan.top_p.append(1.0)
        plan.seeds.append(0)
        if plan.proposal_token_ids:
            plan.proposal_token_ids.extend([-1] * plan.width)
            plan.draft_rows.append(-1)


def mut_out_of_blocks(f, role, plan, shards):
    """Valid sequences first, then more than the pool holds: nothing may be applied."""
    _hogs(f, plan, MAX_SEQS - plan.num_seqs)
    return plan, shards, RuntimeError, False


def mut_too_many_seqs(f, role, plan, shards):
    _hogs(f, plan, MAX_SEQS + 1 - plan.num_seqs)
    return plan, shards, PlanError, False


def mut_huge_width(f, role, plan, shards):
    plan.width = f.rng.choice((MAX_LEN + 1, 2**40, 2**63 - 1))
    plan.proposal_token_ids, plan.draft_rows = [], []
    return plan, (), PlanError, False


def mut_token_oob(f, role, plan, shards):
    j = f.rng.randrange(len(plan.token_ids))
    plan.token_ids[j] = f.rng.choice((VOCAB, VOCAB + 7, 2**31 - 1, -1, -2**31))
    return plan, shards, PlanError, False


def mut_num_new_zero(f, role, plan, shards):
    i = f.rng.randrange(plan.num_seqs)
    start = sum(plan.num_new[:i])
    del plan.token_ids[start:start + plan.num_new[i]]
    plan.num_new[i] = 0
    plan.num_slots[i] = max(plan.num_slots[i], plan.num_computed[i])
    return plan, shards, PlanError, False


def mut_free_and_use(f, role, plan, shards):
    i = f.rng.randrange(plan.num_seqs)
    plan.free_seq_ids = plan.free_seq_ids + [plan.seq_ids[i]]
    plan.num_computed[i] = c = max(plan.num_computed[i], 1)
    plan.num_slots[i] = max(plan.num_slots[i], c + plan.num_new[i] + _lookahead(role, plan, i))
    return plan, shards, PlanError, False


def mut_proposal_oob(f, role, plan, shards):
    if role != "target" or not plan.proposal_token_ids:
        return None
    i = f.rng.randrange(plan.num_seqs)
    m = plan.proposal_lens[i]
    if m and f.rng.random() < 0.6:
        plan.proposal_token_ids[i * K + f.rng.randrange(m)] = f.rng.choice((-1, -7, VOCAB, 2**31 - 1))
    elif m < K:
        plan.proposal_token_ids[i * K + f.rng.randrange(m, K)] = f.rng.choice((-2, VOCAB))
    else:
        return None
    return plan, shards, PlanError, False


def mut_draft_row_oob(f, role, plan, shards):
    if role != "target" or not plan.proposal_token_ids:
        return None
    rows = sum(s.shape[0] for s in shards if s is not None)
    plan.draft_rows[f.rng.randrange(plan.num_seqs)] = rows + f.rng.randint(0, 3)
    return plan, shards, PlanError, False


def mut_bad_shard(f, role, plan, shards):
    if role != "target":
        return None
    bad = f.rng.choice((torch.zeros(2, K + 1, VOCAB), torch.zeros(2, K, VOCAB - 1), torch.zeros(2, K),
                        torch.zeros(2, K, VOCAB, dtype=torch.long), "not a tensor"))
    return plan, (bad,) + tuple(shards), PlanError, False


def mut_lens_over_width(f, role, plan, shards):
    plan.proposal_lens[f.rng.randrange(plan.num_seqs)] = plan.width + 1
    return plan, shards, ProtocolError, False


def mut_ragged_in_process(f, role, plan, shards):
    """Straight to the worker, no decode: the worker checks what decode would have."""
    field = f.rng.choice(("num_slots", "num_new", "seeds", "num_computed"))
    if field == "num_computed":
        plan.num_computed[0] = -1
    else:
        getattr(plan, field).pop()
    return plan, shards, ProtocolError, True


def mut_extreme_knobs(f, role, plan, shards):
    """Hostile but valid: every knob at its edge. Must be served, not refused."""
    rng = f.rng
    n = plan.num_seqs
    plan.temperature = [rng.choice((5e-324, 1e-300, 1e-40, 1e300, 0.0)) for _ in range(n)]
    plan.top_k = [rng.choice((0, 1, 2**31 - 1)) for _ in range(n)]
    plan.top_p = [rng.choice((5e-324, 1e-9, 1.0)) for _ in range(n)]
    plan.seeds = [rng.choice((-2**63, 2**63 - 1, 0, -1)) for _ in range(n)]
    plan.step_id = rng.choice((2**64 - 1, -2**63, 0))
    return plan, shards, "ok", False


def mut_unknown_frees(f, role, plan, shards):
    extra = [f.rng.choice((6000, 2**63 - 1, -2**63, 0x7777)) for _ in range(f.rng.randint(1, 5))]
    plan.free_seq_ids = plan.free_seq_ids + extra + extra
    return plan, shards, "ok", False


MUTATIONS = [(fn.__name__[4:], fn) for fn in (
    mut_dup_seq, mut_unknown_seq, mut_beyond_slots, mut_beyond_written, mut_short_slots, mut_slots_over_len,
    mut_out_of_blocks, mut_too_many_seqs, mut_huge_width, mut_token_oob, mut_num_new_zero, mut_free_and_use,
    mut_proposal_oob, mut_draft_row_oob, mut_bad_shard, mut_lens_over_width, mut_ragged_in_process,
    mut_extreme_knobs, mut_unknown_frees)]


# -- tests --------------------------------------------------------------------------------

def test_fuzzed_workers_keep_serving(paths, hf_model, hf_ref):
    clean = generate(*make_workers(paths))
    ref = hf_model(paths[1])
    for sid, toks in prompts().items():
        if sid != SAMPLED:
            assert clean[sid] == hf_ref.greedy(ref, toks, MAX_TOKENS), sid

    draft, target = make_workers(paths)
    fuzz = Fuzzer(draft, target, seed=2024)
    fuzzed = generate(draft, target, between=lambda where: fuzz.run(CASES_PER_GAP))
    assert fuzzed == clean
    c = fuzz.counts
    print(dict(sorted(c.items())))
    assert c["cases"] >= 4000
    # The fuzz has power: every outcome happened, and many plans reached the workers.
    for outcome in ("accepted", "ProtocolError", "PlanError", "StaleCacheError", "RuntimeError (pool)"):
        assert c[outcome] >= 20, (outcome, dict(c))
    for name, _ in MUTATIONS:
        assert c["mut:" + name] >= 5, (name, dict(c))


def test_refused_plan_leaves_no_partial_state(paths, plan_builder):
    """The old apply resized sequence by sequence: a stale or oversized sequence late in
    the plan left the earlier ones truncated or grown."""
    draft, _ = make_workers(paths)
    kv = draft.runner.kv
    draft.propose(plan_builder([1, 2], [0, 0], [6, 6], list(range(12)), [8, 8], width=K, proposal_lens=[3, 3]))
    before = state(draft)
    with pytest.raises(StaleCacheError):      # seq 1 would grow, seq 9 is not here
        draft.propose(plan_builder([1, 9], [6, 4], [1, 1], [5, 5], [12, 6], width=K, proposal_lens=[1, 1]))
    assert state(draft) == before
    hogs = list(range(100, 100 + MAX_SEQS - 1))
    with pytest.raises(RuntimeError, match=OUT_OF_BLOCKS):
        draft.propose(plan_builder([2] + hogs, [6] + [0] * len(hogs), [1] * MAX_SEQS, [1] * MAX_SEQS,
                                   [MAX_LEN] * MAX_SEQS, width=K, proposal_lens=[0] * MAX_SEQS))
    assert state(draft) == before
    kv.blocks.check_integrity()


def test_growth_may_use_blocks_a_later_sequence_frees(paths, plan_builder):
    """All or nothing is decided for the whole pool: a sequence that grows before another
    shrinks in plan order fits when the total does."""
    _, target = make_workers(paths)
    bm = target.runner.kv.blocks
    per_seq = MAX_LEN // BLOCK
    n_fill = (WORKER_BLOCKS - 1 - per_seq) // per_seq
    fill = list(range(500, 500 + n_fill))
    target.verify(plan_builder(fill, [0] * n_fill, [1] * n_fill, [1] * n_fill, [MAX_LEN] * n_fill, width=0))
    target.verify(plan_builder([1, 2], [0, 0], [4, 4], list(range(8)), [4, MAX_LEN], width=0))
    assert bm.num_free_blocks < per_seq - 1        # seq 1 cannot grow before seq 2 shrinks
    target.verify(plan_builder([1, 2], [4, 4], [1, 1], [3, 3], [MAX_LEN, 5], width=0))
    assert len(bm.block_table(1)) * BLOCK == MAX_LEN and len(bm.block_table(2)) * BLOCK == 2 * BLOCK
    bm.check_integrity()


def test_refusals_name_the_field_and_sequence(paths, plan_builder):
    draft, target = make_workers(paths)
    draft.propose(plan_builder([5], [0], [3], [1, 2, 3], [5], width=K, proposal_lens=[3]))
    cases = [
        (draft, plan_builder([5], [6], [1], [4], [7], width=K), "num_computed[0]: sequence 5 has 5 tokens written"),
        (draft, plan_builder([5], [3], [1], [4], [5], width=K, proposal_lens=[3]), "num_slots[0]: sequence 5"),
        (draft, plan_builder([5], [3], [1], [VOCAB], [6], width=K), "token_ids[0] (sequence 5)"),
        (draft, plan_builder([5], [0], [1], [4], [MAX_LEN + 1], width=K), "num_slots[0]: sequence 5 reserves"),
        (target, plan_builder([6], [0], [2], [1, 2], [5], width=K, proposal_lens=[2],
                              proposal_token_ids=[1, -1, -1], draft_rows=[-1]), "sequence 6 pads inside"),
        (target, plan_builder([6], [0], [2], [1, 2], [5], width=K, proposal_lens=[2], proposal_token_ids=[1, 2, -1],
                              draft_rows=[0]), "draft_rows[0]: sequence 6"),
    ]
    for worker, plan, message in cases:
        before = state(worker)
        call = worker.propose if worker is draft else worker.verify
        with pytest.raises(PlanError, match=re.escape(message)):
            call(plan)
        assert state(worker) == before
