"""Tensor-parallel native executor over gloo: two ranks as threads of this process, each
its own gloo rank on a shared store (no Ray).

References: the whole model (TP 1, the same executor) and the plain transformers forward
for the logits of every family the executor runs, split and replicated KV heads, a
vocabulary the ranks do not divide; transformers' greedy continuation for verify steps
through a rank-0 ``TargetWorker`` whose follower runs ``rank_group.follow``; a chi-square
test that sampled verification keeps the target's distribution; refusals by field.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from scipy.stats import chisquare
from specray_testing import worker_configs

from specray.workers import rank_group
from specray.workers.draft_worker import DraftWorker
from specray.workers.model_runner import ModelRunner
from specray.workers.sampling import logits_to_probs
from specray.workers.target_worker import TargetWorker
from specray.workers.tensor_parallel import RankGroup, Split, check_backend, check_split

TOL = 1e-4
BLOCK = 4
CPU = torch.device("cpu")

FAMILIES = {
    "llama_gqa": ("llama", {}),
    # 3 KV heads over 2 ranks: 2 and 1, with their query heads (as SmolLM2-135M's 9 and 3).
    "llama_uneven": ("llama", {"hidden_size": 48, "num_attention_heads": 6, "num_key_value_heads": 3}),
    # One KV head for two ranks (replicated), tied embeddings, 97 ids (the last slice padded).
    "llama_mqa_tied_v97": ("llama", {"num_key_value_heads": 1, "tie_word_embeddings": True, "vocab_size": 97}),
    "mistral_swa": ("mistral", {"sliding_window": 5}),
    "qwen2_bias": ("qwen2", {}),
    "qwen3_qknorm": ("qwen3", {"head_dim": 16}),
}


@pytest.fixture(scope="module")
def dirs(tiny_model):
    return {name: tiny_model(kind, seed=60 + i, **over) for i, (name, (kind, over)) in enumerate(FAMILIES.items())}


class Ranks:
    """``size`` ranks on threads of their own: ``run(fn)`` calls ``fn(rank)`` on every one at
    once (collectives need them all) and returns the results in rank order."""

    def __init__(self, size: int = 2) -> None:
        self.size = size
        self.pool = ThreadPoolExecutor(size)

    def run(self, fn):
        futures = [self.pool.submit(fn, r) for r in range(self.size)]
        return [f.result(timeout=120) for f in futures]

    def groups(self, timeout_s: float = 30.0, field: str = "tensor_parallel_size") -> list[RankGroup]:
        store = dist.HashStore()
        return self.run(lambda r: RankGroup(store, r, self.size, CPU, timeout_s, field))


@pytest.fixture(scope="module")
def ranks():
    r = Ranks(2)
    yield r
    r.pool.shutdown()


def runner(path, group=None, **model):
    m, c = worker_configs(path, block_size=BLOCK, num_kv_blocks=64, **model)
    return ModelRunner(path, m, c, m.max_model_len, group=group)


def step(runners, plan_builder, state, feeds):
    """One packed step of every sequence in ``feeds`` ({seq: new tokens}) on each runner at
    once (the ranks of a group, or one runner alone); every fed row's logits, per runner."""
    sids = list(feeds)
    comp = [state.get(s, 0) for s in sids]
    new = [len(feeds[s]) for s in sids]
    toks = [t for s in sids for t in feeds[s]]
    plan = plan_builder(sids, comp, new, toks, [c + n for c, n in zip(comp, new)])

    def one(r):
        r.kv.apply(plan)
        return r.forward(sids, comp, new, r.to_device(toks), r.to_device(list(range(len(toks)))))

    for s in sids:
        state[s] = state.get(s, 0) + len(feeds[s])
    if len(runners) == 1:
        return [one(runners[0])]
    with ThreadPoolExecutor(len(runners)) as pool:
        return list(pool.map(one, runners))


@pytest.mark.parametrize("name", list(FAMILIES))
def test_tp2_logits_equal_tp1_and_transformers(name, dirs, ranks, plan_builder, hf_model, hf_ref):
    path = dirs[name]
    groups = ranks.groups()
    tp = ranks.run(lambda r: runner(path, groups[r]))
    whole = runner(path)
    assert tp[0].native.tp is not None and whole.native.tp is None
    heads, kv_heads = whole.native.heads, whole.native.kv_heads
    assert sum(r.native.heads for r in tp) == heads
    assert sum(r.native.kv_heads for r in tp) == max(kv_heads, 2)        # replicated where fewer than ranks
    assert all(r.kv.layers[0][0].shape[1] == r.native.kv_heads for r in tp)
    vocab = whole.vocab_size
    g = torch.Generator().manual_seed(7)
    seqs = {s: torch.randint(0, vocab, (n,), generator=g).tolist() for s, n in ((0, 11), (1, 4), (2, 15))}
    model = hf_model(path)
    s_tp, s_one = {}, {}
    # A packed prefill, a decode step, a ragged verify-shaped step.
    for feeds in ({s: t[:-3] for s, t in seqs.items()}, {s: t[-3:-2] for s, t in seqs.items()},
                  {0: seqs[0][-2:], 1: seqs[1][-2:-1], 2: seqs[2][-2:]}):
        got = step(tp, plan_builder, s_tp, feeds)
        (ref,) = step([whole], plan_builder, s_one, feeds)
        assert got[0].shape == ref.shape == (sum(map(len, feeds.values())), vocab)
        assert torch.equal(got[0], got[1])               # every rank holds the same gathered logits
        assert (got[0] - ref).abs().max().item() < TOL
        rows = got[0].split([len(f) for f in feeds.values()])
        for s, x in zip(feeds, rows):
            full = hf_ref.logits(model, seqs[s][:s_tp[s]])[-len(feeds[s]):]
            assert (x - full).abs().max().item() < TOL
    for g_ in groups:
        g_.close()


def verify_plan(plan_builder, seqs, proposals, computed, width, step_id, **knobs):
    sids = list(seqs)
    lens = [len(proposals[s]) for s in sids]
    flat = [t for s in sids for t in proposals[s] + [-1] * (width - len(proposals[s]))]
    toks = [t for s in sids for t in seqs[s][computed.get(s, 0):]]
    return plan_builder(sids, [computed.get(s, 0) for s in sids], [len(seqs[s]) - computed.get(s, 0) for s in sids],
                        toks, [len(seqs[s]) + k for s, k in zip(sids, lens)], width=width, proposal_lens=lens,
                        proposal_token_ids=flat, draft_rows=knobs.pop("draft_rows", [-1] * len(sids)),
                        step_id=step_id, **knobs)


class Group:
    """A TP-2 target: rank 0's ``TargetWorker`` here, rank 1's following on a thread."""

    def __init__(self, ranks: Ranks, path: str, **cache) -> None:
        groups = ranks.groups()
        m, c = worker_configs(path, block_size=BLOCK, **cache)
        self.workers = ranks.run(lambda r: TargetWorker(m, c, group=groups[r]))
        self.groups = groups
        self.steps = ranks.pool.submit(rank_group.follow, self.workers[1], groups[1])

    @property
    def leader(self) -> TargetWorker:
        return self.workers[0]

    def close(self) -> int:
        self.leader.share.stop()
        n = self.steps.result(timeout=60)
        for g in self.groups:
            g.close()
        return n


@pytest.mark.parametrize("name", ["llama_gqa", "qwen2_bias", "qwen3_qknorm"])
def test_tp2_greedy_verify_equals_transformers(name, dirs, ranks, plan_builder, hf_model, hf_ref):
    path = dirs[name]
    ref = hf_model(path)
    group = Group(ranks, path, num_kv_blocks=64)
    whole = TargetWorker(*worker_configs(path, block_size=BLOCK))
    g = torch.Generator().manual_seed(11)
    seqs = {s: torch.randint(0, 96, (n,), generator=g).tolist() for s, n in ((0, 6), (1, 9), (2, 3))}
    computed: dict[int, int] = {}
    k = 3
    for step_id in range(1, 6):
        want = {s: hf_ref.greedy(ref, t, k + 1) for s, t in seqs.items()}
        # Right proposals, one wrong at a step-dependent place, none: all verify paths.
        proposals = {0: want[0][:k], 1: want[1][:step_id % k] + [(want[1][step_id % k] + 1) % 96], 2: []}
        plan = verify_plan(plan_builder, seqs, proposals, computed, k, step_id)
        got, alone = group.leader.verify(plan), whole.verify(plan)
        assert got.token_ids == alone.token_ids and got.num_emitted == alone.num_emitted
        pos = 0
        for s, n in zip(got.seq_ids, got.num_emitted):
            assert got.token_ids[pos:pos + n] == want[s][:n], (step_id, s)
            computed[s] = len(seqs[s]) + n - 1
            seqs[s] = seqs[s] + got.token_ids[pos:pos + n]
            pos += n
    # A plan the KV cache refuses on every rank alike (it reserves too few slots): the
    # group stays in step and serves the next one.
    bad = verify_plan(plan_builder, seqs, {0: [], 1: [], 2: []}, computed, k, 9)
    bad.num_slots[0] = 1
    with pytest.raises(ValueError, match="num_slots"):
        group.leader.verify(bad)
    plan = verify_plan(plan_builder, seqs, {0: [], 1: [], 2: []}, computed, k, 10)
    got = group.leader.verify(plan)
    assert got.token_ids == [hf_ref.greedy(ref, seqs[s], 1)[0] for s in seqs]
    assert group.close() == 5 + 1                       # rank 1 ran every forward rank 0 ran
    assert group.groups[0].comm_s > 0


def test_tp2_sampled_verify_keeps_the_target_distribution(dirs, ranks, plan_builder, hf_model, hf_ref):
    """600 copies of one prompt, each proposing one token drawn from a fixed draft q:
    the token each emits first must follow the target's p (top-k 6, temperature 1)."""
    path = dirs["llama_gqa"]
    n, vocab = 600, 96
    group = Group(ranks, path, num_kv_blocks=2 * n + 8, max_num_seqs=n)
    prompt = [5, 17, 3, 42]
    g = torch.Generator().manual_seed(13)
    q = torch.rand(vocab, generator=g) ** 4
    q /= q.sum()
    drafted = torch.multinomial(q, n, replacement=True, generator=g).tolist()
    plan = verify_plan(plan_builder, {s: prompt for s in range(n)}, {s: [drafted[s]] for s in range(n)}, {}, 1, 1,
                       draft_rows=list(range(n)), temperature=[1.0] * n, top_k=[6] * n, top_p=[1.0] * n,
                       seeds=list(range(1000, 1000 + n)))
    result = group.leader.verify(plan, q.view(1, 1, vocab).expand(n, 1, vocab).contiguous())
    group.close()
    firsts, pos = [], 0
    for e in result.num_emitted:
        firsts.append(result.token_ids[pos])
        pos += e
    p = logits_to_probs(hf_ref.logits(hf_model(path), prompt)[-1:], torch.tensor([1.0]), [6], [1.0])[0]
    support = [t for t in range(vocab) if p[t] > 0]
    assert len(support) == 6 and set(firsts) <= set(support)
    observed = [firsts.count(t) for t in support]
    expected = [float(p[t]) for t in support]
    assert chisquare(observed, [e * n / sum(expected) for e in expected]).pvalue > 1e-3


def test_tp2_draft_proposes_and_predrafts_as_tp1(dirs, ranks, plan_builder):
    """A draft's ranks run its whole calls: greedy and sampled proposals, their
    probabilities and the pre-draft past them equal the whole model's."""
    path = dirs["qwen2_bias"]
    groups = ranks.groups(field="draft_tensor_parallel_size")
    m, c = worker_configs(path, path, block_size=BLOCK)
    tp = ranks.run(lambda r: DraftWorker(m, c, group=groups[r]))
    following = ranks.pool.submit(rank_group.follow, tp[1], groups[1])
    whole = DraftWorker(m, c)
    g = torch.Generator().manual_seed(17)
    seqs = [torch.randint(0, 96, (n,), generator=g).tolist() for n in (7, 4, 10)]
    width = 3
    plan = plan_builder([0, 1, 2], [0, 0, 0], [len(t) for t in seqs], [t for s in seqs for t in s],
                        [len(t) + 2 * width + 1 for t in seqs], width=width, proposal_lens=[3, 2, 3],
                        temperature=[0.0, 0.8, 1.3], top_k=[0, 0, 5], top_p=[1.0, 0.9, 1.0], seeds=[5, 6, 7],
                        step_id=4)
    (got, probs), (want, want_probs) = tp[0].propose(plan), whole.propose(plan)
    assert got.token_ids == want.token_ids and got.proposal_lens == want.proposal_lens
    assert (probs - want_probs).abs().max().item() < 1e-5
    (pre, _), (pre_want, _) = tp[0].predraft(4), whole.predraft(4)
    assert pre.seq_ids == pre_want.seq_ids == [0, 1, 2] and pre.token_ids == pre_want.token_ids
    tp[0].share.stop()
    assert following.result(timeout=60) == 2
    for grp in groups:
        grp.close()


def test_bad_splits_are_refused_naming_the_field():
    def cfg(heads, kv_heads, inter=64):
        return SimpleNamespace(num_attention_heads=heads, num_key_value_heads=kv_heads, intermediate_size=inter,
                               vocab_size=10)

    with pytest.raises(ValueError, match="tensor_parallel_size=4: num_key_value_heads 3 is fewer than the ranks"):
        check_split(cfg(6, 3), 4)
    with pytest.raises(ValueError, match="draft_tensor_parallel_size=8: num_attention_heads 4 cannot be shared"):
        check_split(cfg(4, 2), 8, "draft_tensor_parallel_size")
    with pytest.raises(ValueError, match="num_attention_heads 6 is not a multiple of num_key_value_heads 4"):
        check_split(cfg(6, 4), 2)
    with pytest.raises(ValueError, match="intermediate_size 64 is not divisible by 3"):
        check_split(cfg(6, 6), 3)
    with pytest.raises(ValueError, match="tensor_parallel_size must be an int"):
        check_split(cfg(6, 3), 0)
    # Uneven: 3 KV heads on 2 ranks, 2 and 1, each with its query heads.
    assert [(s.q_first, s.heads, s.kv_first, s.kv_heads) for s in (Split.of(cfg(9, 3), r, 2) for r in (0, 1))] == \
        [(0, 6, 0, 2), (6, 3, 2, 1)]
    # Fewer KV heads than ranks: replicated, rank r reading KV head r // (size / kv_heads).
    splits = [Split.of(cfg(8, 2), r, 4) for r in range(4)]
    assert [(s.q_first, s.heads, s.kv_first, s.kv_heads, s.inter, s.vocab) for s in splits] == \
        [(0, 2, 0, 1, 16, 3), (2, 2, 0, 1, 16, 3), (4, 2, 1, 1, 16, 3), (6, 2, 1, 1, 16, 3)]


def test_half_precision_on_gloo_is_refused_naming_dtype(dirs, ranks):
    with pytest.raises(ValueError, match="dtype=bfloat16: .*gloo"):
        check_backend(CPU, torch.bfloat16)
    check_backend(CPU, torch.float32)
    path = dirs["llama_gqa"]
    groups = ranks.groups()
    with pytest.raises(ValueError, match="dtype=float16"):
        ranks.run(lambda r: runner(path, groups[r], dtype="float16"))


def test_the_transformers_executor_is_refused_with_tensor_parallel(dirs, ranks):
    path = dirs["llama_gqa"]
    groups = ranks.groups(field="draft_tensor_parallel_size")
    with pytest.raises(ValueError, match="draft_tensor_parallel_size=2 needs the native executor"):
        ranks.run(lambda r: runner(path, groups[r], executor="transformers"))


def test_a_rank_left_alone_does_not_wait_for_ever(ranks):
    """A peer that never joins the collective: the wait ends at the group's timeout, and
    the group counts as broken."""
    groups = ranks.groups(timeout_s=1.0)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError):
        groups[0].all_reduce(torch.ones(4))
    assert time.monotonic() - t0 < 10 and groups[0].broken
