"""The native Llama-family executor against transformers.

Three independent references: (1) greedy decoding through the runner (packed prefill,
decode, multi-token verify steps, preemption with recompute) must equal transformers'
``generate`` token for token; (2) every fed position's logits must match the plain
transformers forward within ``TOL`` (float32) / ``BF16_TOL`` (bfloat16); (3) a runner forced
onto the transformers path gives the same logits over the same paged cache.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys

import pytest
import torch
from specray_testing import hf_greedy, model_runner

from specray.workers import llama_model
from specray.workers.config import ModelConfig

VOCAB = 96
BLOCK = 4
TOL = 1e-4          # float32 logits, native vs transformers
BF16_TOL = 0.1      # bfloat16 logits (|logit| ~ 10 here; bf16 keeps 8 bits of mantissa)

FAMILIES = {
    "llama_gqa": ("llama", {}),
    "llama3_rope": ("llama", {"rope_parameters": {
        "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 16}}),
    "llama_linear_tied": ("llama", {"rope_parameters": {"rope_type": "linear", "rope_theta": 500.0, "factor": 2.0},
                                    "tie_word_embeddings": True}),
    "mistral_swa": ("mistral", {"sliding_window": 5}),
    "qwen2_bias": ("qwen2", {}),
    "qwen2_swa": ("qwen2", {"use_sliding_window": True, "sliding_window": 5, "max_window_layers": 1}),
    "qwen3_qknorm": ("qwen3", {"head_dim": 16}),
}


@pytest.fixture(scope="module")
def dirs(tiny_model):
    return {name: tiny_model(kind, seed=20 + i, **over) for i, (name, (kind, over)) in enumerate(FAMILIES.items())}


def runner_for(path, executor="native", dtype="float32", blocks=64):
    return model_runner(path, dtype=dtype, block_size=BLOCK, num_kv_blocks=blocks, executor=executor)


class Greedy:
    """Greedy decoding through a runner as driver + worker would drive it. With ``wanted``,
    a step asks for the logits of each sequence's last ``wanted(s, fed)`` rows only, and says
    so (``tail``), as the workers do: a prefill's last layer then runs on those rows alone."""

    def __init__(self, runner, plan_builder, wanted=None):
        self.r, self.plan, self.wanted = runner, plan_builder, wanted
        self.tokens: dict[int, list[int]] = {}
        self.computed: dict[int, int] = {}
        self.tail_steps = 0

    def step(self, feeds: dict[int, list[int]], free=()):
        r = self.r
        sids = list(feeds)
        comp = [self.computed.get(s, 0) for s in sids]
        new = [len(feeds[s]) for s in sids]
        toks = [t for s in sids for t in feeds[s]]
        r.kv.apply(self.plan(sids, comp, new, toks, [c + n for c, n in zip(comp, new)], free_seq_ids=list(free)))
        for s in free:
            self.computed.pop(s, None)
        if self.wanted is None:
            keep, tail = new, None
            index = list(range(len(toks)))
        else:
            keep = tail = [self.wanted(s, n) for s, n in zip(sids, new)]
            ends = itertools.accumulate(new)
            index = [row for e, w in zip(ends, keep) for row in range(e - w, e)]
            self.tail_steps += 2 * sum(tail) <= len(toks)
        logits = r.forward(sids, comp, new, r.to_device(toks), r.to_device(index), tail=tail)
        out = {}
        for s, rows, c in zip(sids, logits.split(keep), comp):
            self.computed[s] = c + len(feeds[s])
            out[s] = rows
        return out


@pytest.mark.parametrize("tails", [False, True], ids=["all_rows", "tails"])
@pytest.mark.parametrize("name", list(FAMILIES))
def test_native_greedy_equals_generate(name, tails, dirs, plan_builder):
    path = dirs[name]
    runner = runner_for(path)
    assert runner.executor == "native"
    g = torch.Generator().manual_seed(3)
    prompts = {s: torch.randint(0, VOCAB, (n,), generator=g).tolist() for s, n in zip(range(3), (9, 3, 14))}
    n_new = 12
    want = dict(zip(prompts, hf_greedy(path, list(prompts.values()), n_new)))
    # With tails: the last row of a prefill or decode, the three rows of a verify step.
    verify: set[int] = set()
    gr = Greedy(runner, plan_builder, wanted=(lambda s, fed: 3 if s in verify else 1) if tails else None)
    got = {s: [] for s in prompts}
    # Packed prefill of a mixed batch; sequence 1 joins one step late.
    first = {s: p for s, p in prompts.items() if s != 1}
    out = gr.step(first)
    for s in first:
        got[s].append(int(out[s][-1].argmax()))
    step = 0
    while any(len(v) < n_new for v in got.values()):
        step += 1
        feeds = {}
        for s in prompts:
            if s not in gr.computed:
                feeds[s] = prompts[s] + got[s]                   # (re)prefill: joining late or recomputed
            elif len(got[s]) < n_new:
                feeds[s] = got[s][-1:]
        verify.clear()
        if step % 3 == 0:
            # A verify-shaped step: the last token plus the reference's next two (a correct
            # proposal); the three rows then predict the next three tokens.
            for s in list(feeds):
                if s in gr.computed and len(got[s]) + 3 <= n_new:
                    feeds[s] = got[s][-1:] + want[s][len(got[s]):len(got[s]) + 2]
                    verify.add(s)
        free = [2] if step == 5 else []                        # preempt sequence 2, recompute it next step
        if free:
            feeds.pop(2, None)
        out = gr.step(feeds, free=free)
        for s, rows in out.items():
            produced = rows.argmax(-1).tolist()
            got[s] += produced if s in verify else produced[-1:]
    assert got == want, (str(got), str(want))
    assert gr.tail_steps >= (2 if tails else 0)     # the first prefill and the recompute


@pytest.mark.parametrize("name", list(FAMILIES))
def test_native_logits_match_transformers(name, dirs, plan_builder, hf_model, hf_ref):
    path = dirs[name]
    native, ref_runner = runner_for(path), runner_for(path, executor="transformers")
    assert (native.executor, ref_runner.executor) == ("native", "transformers")
    g = torch.Generator().manual_seed(5)
    seqs = {s: torch.randint(0, VOCAB, (n,), generator=g).tolist() for s, n in ((0, 11), (1, 4), (2, 17))}
    a, b = Greedy(native, plan_builder), Greedy(ref_runner, plan_builder)
    model = hf_model(path)
    for feeds in ({s: t[:-3] for s, t in seqs.items()}, {s: t[-3:-2] for s, t in seqs.items()},
                  {0: seqs[0][-2:], 1: seqs[1][-2:-1], 2: seqs[2][-2:]}):
        x, y = a.step(feeds), b.step(feeds)
        for s in feeds:
            assert (x[s] - y[s]).abs().max().item() < TOL
            full = hf_ref.logits(model, seqs[s][:a.computed[s]])[-len(feeds[s]):]
            assert (x[s] - full).abs().max().item() < TOL


@pytest.mark.parametrize("name", ["llama_gqa", "qwen3_qknorm"])
def test_native_bfloat16_close_to_transformers_bfloat16(name, dirs, plan_builder):
    path = dirs[name]
    native, ref_runner = runner_for(path, dtype="bfloat16"), runner_for(path, "transformers", dtype="bfloat16")
    assert native.kv.layers[0][0].dtype == torch.bfloat16
    g = torch.Generator().manual_seed(9)
    seqs = {s: torch.randint(0, VOCAB, (n,), generator=g).tolist() for s, n in ((0, 13), (1, 6))}
    a, b = Greedy(native, plan_builder), Greedy(ref_runner, plan_builder)
    for feeds in ({s: t[:-1] for s, t in seqs.items()}, {s: t[-1:] for s, t in seqs.items()}):
        x, y = a.step(feeds), b.step(feeds)
        for s in feeds:
            assert x[s].dtype == torch.float32
            assert (x[s] - y[s]).abs().max().item() < BF16_TOL


def test_dynamic_rope_falls_back_to_transformers(tiny_model):
    path = tiny_model("llama", seed=40, rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0,
                                                          "factor": 2.0})
    assert runner_for(path, executor="auto").executor == "transformers"
    with pytest.raises(ValueError, match="rope_type 'dynamic'"):
        runner_for(path, executor="native")


def test_an_attention_bias_falls_back_to_transformers(tiny_model):
    path = tiny_model("llama", seed=41, attention_bias=True)
    assert runner_for(path, executor="auto").executor == "transformers"
    with pytest.raises(ValueError, match="attention_bias"):
        runner_for(path, executor="native")


def test_supports_names_unknown_families():
    assert "gpt2" in llama_model.supports(type("C", (), {"model_type": "gpt2"})())


def test_executor_choice_is_checked():
    with pytest.raises(ValueError, match="executor"):
        ModelConfig(target="x", executor="fast")


@pytest.mark.parametrize("name", ["llama_gqa", "mistral_swa", "qwen3_qknorm"])
def test_a_forward_asked_for_tails_gives_their_logits_and_writes_every_rows_cache(name, dirs, plan_builder):
    # Two runners over the same checkpoint and plans: one computes every row, the other is
    # told where the wanted rows lie. A mixed step: a cached sequence feeding a chunk (two
    # wanted rows, one asked twice), one wanting nothing (left out of the tail), a fresh
    # prompt (its last row).
    path = dirs[name]
    full, part = runner_for(path), runner_for(path)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (9, 3)]
    for r in (full, part):
        r.kv.apply(plan_builder([0, 1], [0, 0], [9, 3], prompts[0] + prompts[1], [9, 3]))
        r.forward([0, 1], [0, 0], [9, 3], r.to_device(prompts[0] + prompts[1]), r.to_device([8, 11]))
    feeds = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (7, 1, 12)]
    toks = [t for f in feeds for t in f]
    comp, new = [9, 3, 0], [7, 1, 12]
    index = [5, 6, 6, 19]
    for r in (full, part):
        r.kv.apply(plan_builder([0, 1, 2], comp, new, toks, [c + n for c, n in zip(comp, new)]))
    want = full.forward([0, 1, 2], comp, new, full.to_device(toks), full.to_device(list(range(20))))
    got = part.forward([0, 1, 2], comp, new, part.to_device(toks), part.to_device(index), tail=[2, 0, 1])
    assert torch.allclose(got, want[index], atol=1e-5, rtol=0)
    # Every fed row's K/V reached the cache, in every layer, the last one included.
    for sid, length in zip([0, 1, 2], [16, 4, 12]):
        slots = [b * BLOCK + j for b in full.kv.tables([sid])[0] for j in range(BLOCK)][:length]
        for (fk, fv), (pk, pv) in zip(full.kv.layers, part.kv.layers):
            assert torch.equal(fk[slots], pk[slots]) and torch.equal(fv[slots], pv[slots])
    assert full.kv.tables([0, 1, 2]) == part.kv.tables([0, 1, 2])
    # A tail longer than what its sequence feeds (it would reach into the previous
    # sequence's rows) is not taken: the step runs whole.
    feeds = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (1, 1, 12)]
    toks = [t for f in feeds for t in f]
    comp, new = [16, 4, 12], [1, 1, 12]
    for r in (full, part):
        r.kv.apply(plan_builder([0, 1, 2], comp, new, toks, [c + n for c, n in zip(comp, new)]))
    want = full.forward([0, 1, 2], comp, new, full.to_device(toks), full.to_device(list(range(14))))
    got = part.forward([0, 1, 2], comp, new, part.to_device(toks), part.to_device([0, 1, 13]), tail=[1, 2, 1])
    assert torch.allclose(got, want[[0, 1, 13]], atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_what_the_config_decides_equals_transformers_modules(name, dirs):
    """Each layer's window and scaling and the rotary frequencies, derived from the config
    for a checkpoint read directly, are what transformers' modules hold."""
    from transformers import AutoModelForCausalLM

    from specray.workers.rotary import inverse_frequencies

    hf = AutoModelForCausalLM.from_pretrained(dirs[name], dtype=torch.float32)
    cfg = hf.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    for i, layer in enumerate(hf.model.layers):
        a = layer.self_attn
        held = a.sliding_window if hasattr(a, "sliding_window") else getattr(cfg, "sliding_window", None)
        assert llama_model.layer_window(cfg, i) == held
        assert head_dim ** -0.5 == a.scaling
    inv_freq, scale = inverse_frequencies(cfg)
    assert torch.equal(inv_freq, hf.model.rotary_emb.inv_freq) and scale == hf.model.rotary_emb.attention_scaling


@pytest.mark.parametrize("name", ["llama_linear_tied", "qwen2_swa", "qwen3_qknorm"])
def test_a_checkpoint_read_directly_builds_what_transformers_loading_builds(name, dirs):
    from transformers import AutoModelForCausalLM

    from specray.workers import model_loader

    hf = AutoModelForCausalLM.from_pretrained(dirs[name], dtype=torch.float32)
    via_hf = llama_model.NativeCausalLM.from_hf(hf, 64)
    config = model_loader.load_config(dirs[name])
    weights = model_loader.load_weights(model_loader.safetensors_files(dirs[name]), torch.float32, torch.device("cpu"))
    direct = llama_model.NativeCausalLM.from_weights(config, weights, 64)
    for attr in ("embed", "norm", "lm_head"):
        assert torch.equal(getattr(direct, attr), getattr(via_hf, attr))
    assert torch.equal(direct.rotary.table, via_hf.rotary.table)
    for x, y in zip(direct.layers, via_hf.layers, strict=True):
        for slot in x.__slots__:
            u, v = getattr(x, slot), getattr(y, slot)
            assert torch.equal(u, v) if isinstance(u, torch.Tensor) else u == v, slot


def test_a_checkpoint_missing_a_tensor_is_refused_naming_it(dirs):
    from specray.workers import model_loader

    path = dirs["llama_gqa"]
    weights = model_loader.load_weights(model_loader.safetensors_files(path), torch.float32, torch.device("cpu"))
    del weights["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(ValueError, match=r"no model\.layers\.1\.mlp\.up_proj\.weight"):
        llama_model.NativeCausalLM.from_weights(model_loader.load_config(path), weights, 64)


def test_a_native_worker_starts_without_transformers(dirs):
    """Importing transformers (its modeling code, or its config classes) is most of a
    worker's start: a checkpoint the native executor runs, whose config.json says all it
    reads, is loaded without it."""
    code = ("import sys; from specray_testing import model_runner; "
            "import specray.workers.target_worker, specray.workers.draft_worker; "
            f"r = model_runner({dirs['llama_gqa']!r}, block_size=4, num_kv_blocks=8); "
            "print(r.executor, any(m.split('.')[0] == 'transformers' for m in sys.modules))")
    tests = os.path.dirname(os.path.dirname(__file__))         # where specray_testing lives
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, PYTHONPATH=tests), check=True)
    assert out.stdout.split()[-2:] == ["native", "False"], out.stderr[-2000:]
