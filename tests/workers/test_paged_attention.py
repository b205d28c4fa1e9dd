"""ModelRunner over the paged KV cache against the plain transformers model.

Each step reserves slots through ``KVCache.apply(StepPlan)`` exactly as the driver's plan
does, then runs one packed forward; every fed position's logits must equal the plain
model's logits over the whole sequence. The pool is fragmented first (other sequences
allocated, written and freed) so block tables are non-contiguous and freed blocks hold
stale K/V.
"""

from __future__ import annotations

import types

import pytest
import torch
from specray_testing import model_runner

from specray.workers.paged_attention import attention_parts, build_metadata, paged_attention

VOCAB = 96
BLOCK = 4
LOOKAHEAD = 3
TOL = 1e-4

MODELS = {
    "llama": ("llama", {}),                                   # GQA: 4 heads, 2 kv heads
    "qwen2": ("qwen2", {}),                                   # qkv biases
    "mistral_swa": ("mistral", {"sliding_window": 5}),        # window shorter than the sequences
    "qwen2_swa": ("qwen2", {"use_sliding_window": True, "sliding_window": 5, "max_window_layers": 1}),
}


class Harness:
    """Drives a ModelRunner the way driver + worker do, keeping each sequence's tokens."""

    def __init__(self, runner, ref, plan_builder, ref_logits):
        self.runner, self.ref, self.plan_builder, self.ref_logits = runner, ref, plan_builder, ref_logits
        self.tokens: dict[int, list[int]] = {}
        self.max_diff = 0.0

    def step(self, items, free=(), check=True):
        """items: (seq_id, num_computed, new_tokens, lookahead_slots). Returns per-seq logits."""
        r = self.runner
        seq_ids = [s for s, _, _, _ in items]
        computed = [c for _, c, _, _ in items]
        num_new = [len(t) for _, _, t, _ in items]
        toks = [x for _, _, t, _ in items for x in t]
        slots = [c + len(t) + la for _, c, t, la in items]
        for sid in free:
            self.tokens.pop(sid)
        r.kv.apply(self.plan_builder(seq_ids, computed, num_new, toks, slots, free_seq_ids=free))
        r.kv.blocks.check_integrity()
        for sid, s in zip(seq_ids, slots):
            assert len(r.kv.blocks.block_table(sid)) * BLOCK == -(-s // BLOCK) * BLOCK     # truncation freed the rest
        logits = r.forward(seq_ids, computed, num_new, r.to_device(toks), r.to_device(list(range(len(toks)))))
        assert logits.shape == (len(toks), VOCAB) and logits.dtype == torch.float32
        out = {}
        for (sid, c, new, _), rows in zip(items, logits.split(num_new)):
            self.tokens[sid] = self.tokens.get(sid, [])[:c] + list(new)
            out[sid] = rows
            if check:
                ref = self.ref_logits(self.ref, self.tokens[sid])[c:]
                diff = (rows - ref).abs().max().item()
                self.max_diff = max(self.max_diff, diff)
                assert diff < TOL, f"seq {sid}: max |paged - hf| = {diff:.3g} (fed {len(new)} after {c})"
        return out


@pytest.fixture(scope="module")
def model_dirs(tiny_model):
    return {name: tiny_model(kind, seed=i + 1, **over) for i, (name, (kind, over)) in enumerate(MODELS.items())}


@pytest.mark.parametrize("name", list(MODELS))
def test_paged_runner_matches_hf(name, model_dirs, hf_model, plan_builder, hf_ref):
    path = model_dirs[name]
    runner = model_runner(path, block_size=BLOCK, num_kv_blocks=48)
    h = Harness(runner, hf_model(path), plan_builder, hf_ref.logits)
    g = torch.Generator().manual_seed(7)

    def rand(n):
        return torch.randint(0, VOCAB, (n,), generator=g).tolist()

    # 1. Other sequences take blocks and write K/V into them; two are then freed.
    junk = {100: rand(7), 101: rand(3), 102: rand(10), 103: rand(2)}
    h.step([(sid, 0, t, 0) for sid, t in junk.items()], check=False)

    # 2. Packed prefill of three sequences spanning several blocks, into the fragmented pool.
    lens = {2: 14, 0: 9, 1: 5}
    h.step([(sid, 0, rand(n), LOOKAHEAD) for sid, n in lens.items()], free=[100, 102])
    tables = [runner.kv.blocks.block_table(sid) for sid in lens]
    assert any(t != list(range(t[0], t[0] + len(t))) for t in tables), tables   # non-contiguous
    assert max(len(t) for t in tables) >= 4

    def cur(sid):
        return len(h.tokens[sid])

    # 3. Decode one token per sequence, then three (a verify-shaped step), then mixed widths,
    #    with a sequence whose K/V was written before the others' came and went.
    h.step([(sid, cur(sid), rand(1), LOOKAHEAD) for sid in lens])
    h.step([(sid, cur(sid), rand(3), LOOKAHEAD) for sid in lens])
    h.step([(0, cur(0), rand(2), LOOKAHEAD), (101, 3, rand(2), 0), (1, cur(1), rand(1), LOOKAHEAD),
            (2, cur(2), rand(3), 0)])

    # 4. Rollback: drop rejected tokens (one sequence across a block boundary) and feed
    #    different ones; the stale slots must be overwritten, not read.
    def replace(sid, back, n):
        c = cur(sid) - back
        old = h.tokens[sid][c:c + n]
        new = [(t + 1 + i) % VOCAB for i, t in enumerate(old)] + rand(n - len(old))
        return (sid, c, new, LOOKAHEAD)

    before = {sid: len(runner.kv.blocks.block_table(sid)) for sid in lens}
    h.step([replace(0, 3, 2), replace(1, 1, 1), replace(2, 6, 1)])
    assert len(runner.kv.blocks.block_table(2)) < before[2]        # blocks past the new length freed
    # ... and decoding continues on top of the rolled-back cache.
    h.step([(sid, cur(sid), rand(2), 0) for sid in lens], free=[101, 103])
    h.step([(sid, cur(sid), rand(1), LOOKAHEAD) for sid in lens])
    assert h.max_diff < TOL


def test_paged_runner_bfloat16_smoke(model_dirs, hf_model, plan_builder, hf_ref):
    path = model_dirs["llama"]
    runner = model_runner(path, dtype="bfloat16", block_size=BLOCK, num_kv_blocks=16)
    assert runner.dtype == torch.bfloat16 and runner.kv.layers[0][0].dtype == torch.bfloat16
    g = torch.Generator().manual_seed(8)
    seqs = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (6, 11)]
    toks = [t for s in seqs for t in s]
    lens = [len(s) for s in seqs]
    runner.kv.apply(plan_builder([0, 1], [0, 0], lens, toks, lens))
    logits = runner.forward([0, 1], [0, 0], lens, runner.to_device(toks), torch.arange(len(toks)))
    assert logits.dtype == torch.float32 and bool(torch.isfinite(logits).all())
    ref = torch.cat([hf_ref.logits(hf_model(path), s) for s in seqs])
    agree = (logits.argmax(-1) == ref.argmax(-1)).double().mean().item()
    assert agree >= 0.8, agree
    assert (logits - ref).abs().max().item() < 0.5
    # A decode step on top of the bf16 cache.
    runner.kv.apply(plan_builder([1], [11], [1], [5], [12]))
    out = runner.forward([1], [11], [1], runner.to_device([5]), torch.arange(1))
    ref = hf_ref.logits(hf_model(path), seqs[1] + [5])[-1:]
    assert bool(torch.isfinite(out).all()) and (out - ref).abs().max().item() < 0.5


def test_kv_cache_apply_refuses_inconsistent_plans(model_dirs, plan_builder):
    runner = model_runner(model_dirs["llama"], block_size=BLOCK, num_kv_blocks=4)
    # A sequence the worker does not hold (e.g. it restarted) cannot claim cached tokens.
    with pytest.raises(RuntimeError, match="restarted"):
        runner.kv.apply(plan_builder([7], [5], [1], [3], [6]))
    # More slots than the pool has: the driver's mirror disagrees.
    with pytest.raises(RuntimeError, match="out of blocks"):
        runner.kv.apply(plan_builder([8], [0], [17], list(range(17)), [17]))
    runner.kv.blocks.check_integrity()
    assert runner.kv.blocks.num_free_blocks == 4
    with pytest.raises(ValueError, match="vocabulary"):
        runner.check_tokens(plan_builder([9], [0], [2], [1, VOCAB], [2]))


def test_attention_parts_bound_the_padding_and_cover_every_sequence_once():
    # A prompt chunk among decoding sequences attends apart from them.
    assert attention_parts([5, 5, 256, 5]) == [[2], [0, 1, 3]]
    assert attention_parts([3, 3, 3]) == [[0, 1, 2]]
    assert attention_parts([5, 5, 3, 5, 2]) == [[0, 1, 2, 3, 4]]         # adaptive k: one batch
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        num_new = torch.randint(1, 40, (int(torch.randint(1, 9, (1,), generator=g)),), generator=g).tolist()
        parts = attention_parts(num_new)
        assert sorted(i for part in parts for i in part) == list(range(len(num_new)))
        for part in parts:
            assert 2 * len(part) * max(num_new[i] for i in part) <= 3 * sum(num_new[i] for i in part)


@pytest.mark.parametrize("split", [True, False])
@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("num_computed, num_new", [
    ([0, 7, 12, 3, 9], [6, 1, 1, 4, 1]),      # prefill, decode and verify rows together (ragged)
    ([0, 7, 12, 3, 9], [16, 1, 1, 4, 1]),     # a longer prefill: it attends apart
    ([5, 0, 10], [3, 3, 3]),                  # every sequence feeds as many tokens
    ([0, 0, 0], [6, 2, 7]),                   # nothing cached
])
def test_paged_attention_matches_per_sequence_reference(num_computed, num_new, window, split):
    """paged_attention + build_metadata on random inputs against plain softmax attention over
    each sequence's own contiguous K/V: shuffled blocks, stale slots, GQA; a ragged batch
    attends in parts (``split``) or as one padded batch, with the same result."""
    g = torch.Generator().manual_seed(len(num_new) + (window or 0))
    heads, kvh, d, bs, num_blocks, layer = 4, 2, 8, 4, 24, 1
    scale = d ** -0.5
    totals = [c + q for c, q in zip(num_computed, num_new)]
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables = []
    for total in totals:                      # one lookahead block past what the step needs
        tables.append(perm[:-(-total // bs) + 1])
        perm = perm[len(tables[-1]):]
    # Every slot starts with stale values: only what the step writes or had cached may be read.
    kv = [(torch.randn(num_blocks * bs, kvh, d, generator=g), torch.randn(num_blocks * bs, kvh, d, generator=g))
          for _ in range(2)]
    k_cache, v_cache = kv[layer]
    ks = [torch.randn(t, kvh, d, generator=g) for t in totals]
    vs = [torch.randn(t, kvh, d, generator=g) for t in totals]
    qs = [torch.randn(q, heads, d, generator=g) for q in num_new]

    def slots(i, positions):
        return torch.tensor([tables[i][p // bs] * bs + p % bs for p in positions], dtype=torch.long)

    for i, c in enumerate(num_computed):
        k_cache[slots(i, range(c))] = ks[i][:c]
        v_cache[slots(i, range(c))] = vs[i][:c]

    def packed(xs):                           # per sequence [q, heads, D] -> [1, heads, T, D]
        return torch.cat(xs).transpose(0, 1)[None]

    def new(xs):
        return [x[c:] for x, c in zip(xs, num_computed)]

    meta, positions = build_metadata(kv, tables, num_computed, num_new, bs, torch.device("cpu"), split=split)
    assert (meta.parts is not None) == (split and len(attention_parts(num_new)) > 1 and len(set(num_new)) > 1)
    assert positions.tolist() == [p for c, q in zip(num_computed, num_new) for p in range(c, c + q)]
    out, _ = paged_attention(types.SimpleNamespace(layer_idx=layer), packed(qs), packed(new(ks)), packed(new(vs)), None,
                             scaling=scale, specray_meta=meta, sliding_window=window)

    refs = []
    for i, (c, q) in enumerate(zip(num_computed, num_new)):
        k = ks[i].repeat_interleave(heads // kvh, dim=1).transpose(0, 1)       # [heads, total, D]
        v = vs[i].repeat_interleave(heads // kvh, dim=1).transpose(0, 1)
        qpos = torch.arange(c, c + q).unsqueeze(-1)
        kpos = torch.arange(totals[i])
        visible = (kpos <= qpos) & ((kpos > qpos - window) if window else True)
        scores = (qs[i].transpose(0, 1) @ k.transpose(1, 2) * scale).masked_fill(~visible, float("-inf"))
        refs.append((scores.softmax(-1) @ v).transpose(0, 1))                   # [q, heads, D]
    assert out.shape == (1, sum(num_new), heads, d)
    torch.testing.assert_close(out[0], torch.cat(refs), atol=1e-5, rtol=1e-5)
    for i, total in enumerate(totals):                                          # new K/V written in place
        torch.testing.assert_close(k_cache[slots(i, range(total))], ks[i], atol=0, rtol=0)
        torch.testing.assert_close(v_cache[slots(i, range(total))], vs[i], atol=0, rtol=0)
