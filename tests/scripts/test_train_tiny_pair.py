"""Tests for scripts/train_tiny_pair.py and the model pair it ships under models/."""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))

import train_tiny_pair as ttp  # noqa: E402

MODELS = REPO / "models"
PAIR = {"target": MODELS / "tiny-target", "draft": MODELS / "tiny-draft"}


@pytest.fixture(autouse=True)
def _offline_one_thread(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def corpus():
    return ttp.load_corpus()


# ---------------------------------------------------------------- data


def test_file_list_sorted_and_filtered():
    files = ttp.list_source_files()
    assert len(files) > 100
    root = ttp.default_stdlib_dir()
    rel = [f.relative_to(root).as_posix() for f in files]
    assert rel == sorted(rel)
    assert len(set(rel)) == len(rel)
    for r in rel:
        parts = r.split("/")
        assert r.endswith(".py")
        assert not set(parts[:-1]) & ttp.SKIP_DIRS, r
        assert not parts[-1].startswith(ttp.SKIP_FILE_PREFIXES), r
    assert "argparse.py" in rel


def test_split_disjoint_by_file_and_deterministic():
    files = ttp.list_source_files()
    train, held_out = ttp.split_files(files)
    assert train and held_out
    assert not set(train) & set(held_out)
    assert sorted(train + held_out) == sorted(files)
    assert held_out == files[ttp.EVAL_EVERY - 1 :: ttp.EVAL_EVERY]
    assert (train, held_out) == ttp.split_files(ttp.list_source_files())


def test_load_corpus_nonempty_and_deterministic(corpus):
    train_bytes, eval_bytes = corpus
    assert isinstance(train_bytes, bytes) and isinstance(eval_bytes, bytes)
    assert len(train_bytes) > 1_000_000
    assert len(eval_bytes) > 10 * ttp.SEQ_LEN
    assert len(train_bytes) > 5 * len(eval_bytes)
    assert ttp.load_corpus() == corpus
    # held-out files really are held out: a distinctive chunk of each is absent from train
    root = ttp.default_stdlib_dir()
    _, held_out = ttp.split_files(ttp.list_source_files(root))
    for path in held_out[:5]:
        text = path.read_bytes()
        assert text[:200] in eval_bytes


def test_encode_matches_byt5_tokenizer():
    text = "def f(x):\n    return x + 1  # é"
    ids = ttp.encode_bytes(text.encode("utf-8"))
    assert ids.dtype == torch.int64
    tok = ttp.make_tokenizer()
    assert len(tok) == ttp.VOCAB_SIZE == 259
    assert (tok.pad_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2)
    assert tok(text, add_special_tokens=False).input_ids == ids.tolist()
    assert ids.tolist() == [b + 3 for b in text.encode("utf-8")]


def test_batches_shape_dtype_range(corpus):
    train_bytes, _ = corpus
    gen = torch.Generator().manual_seed(0)
    stream = ttp.batches(train_bytes, 4, 32, gen)
    for _ in range(3):
        batch = next(stream)
        assert batch.shape == (4, 32)
        assert batch.dtype == torch.int64
        assert int(batch.min()) >= 3 and int(batch.max()) <= 258
        for row in batch:
            assert bytes((row - 3).tolist()) in train_bytes
    a = next(ttp.batches(train_bytes, 4, 32, torch.Generator().manual_seed(7)))
    b = next(ttp.batches(train_bytes, 4, 32, torch.Generator().manual_seed(7)))
    assert torch.equal(a, b)


def test_eval_windows_deterministic(corpus):
    _, eval_bytes = corpus
    w = ttp.eval_windows(eval_bytes, 64, max_windows=10)
    assert w.shape == (10, 64)
    assert torch.equal(w, ttp.eval_windows(eval_bytes, 64, max_windows=10))
    assert torch.equal(w[0], ttp.encode_bytes(eval_bytes[:64]))


# ---------------------------------------------------------------- models / training


@pytest.mark.parametrize("kind", ["target", "draft"])
def test_build_model_config(kind):
    cfg = ttp.model_config(kind)
    assert cfg.vocab_size == ttp.VOCAB_SIZE
    assert cfg.max_position_embeddings == 2048
    assert (cfg.eos_token_id, cfg.pad_token_id) == (1, 0)
    assert cfg.hidden_size == ttp.MODEL_SPECS[kind]["hidden_size"]
    assert cfg.num_hidden_layers == ttp.MODEL_SPECS[kind]["num_hidden_layers"]


def test_target_larger_than_draft():
    assert ttp.count_parameters(ttp.build_model("target")) > 5 * ttp.count_parameters(
        ttp.build_model("draft")
    )


def test_train_step_finite_and_updates_params(corpus):
    train_bytes, _ = corpus
    torch.manual_seed(0)
    model = ttp.build_model("draft")
    opt = ttp.make_optimizer(model, 1e-3)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    batch = next(ttp.batches(train_bytes, 2, 64, torch.Generator().manual_seed(0)))
    loss = ttp.train_step(model, opt, batch)
    assert math.isfinite(loss)
    # untrained: close to uniform over 259 ids
    assert abs(loss - math.log(ttp.VOCAB_SIZE)) < 1.0
    changed = [n for n, p in model.named_parameters() if not torch.equal(p, before[n])]
    assert "model.layers.0.self_attn.q_proj.weight" in changed
    assert "lm_head.weight" in changed


def test_lr_schedule():
    peak = 1e-3
    lrs = [ttp.lr_at(s, 1000, peak) for s in range(1000)]
    assert lrs[0] < lrs[ttp.WARMUP_STEPS - 1] == pytest.approx(peak)
    assert max(lrs) == pytest.approx(peak)
    assert lrs[-1] == pytest.approx(peak * ttp.MIN_LR_FRACTION, rel=1e-3)
    assert all(a >= b for a, b in zip(lrs[ttp.WARMUP_STEPS :], lrs[ttp.WARMUP_STEPS + 1 :]))


def test_evaluate_and_acceptance_untrained(corpus):
    _, eval_bytes = corpus
    torch.manual_seed(0)
    target, draft = ttp.build_model("target"), ttp.build_model("draft")
    bpb = ttp.evaluate_bits_per_byte(draft, eval_bytes, seq_len=32, max_windows=4)
    assert abs(bpb - math.log2(ttp.VOCAB_SIZE)) < 1.0
    acc = ttp.measure_acceptance(target, draft, eval_bytes, seq_len=32, max_windows=2)
    assert 0.0 <= acc["greedy"] <= 1.0 and 0.0 < acc["sampled"] <= 1.0
    same = ttp.measure_acceptance(draft, draft, eval_bytes, seq_len=32, max_windows=2)
    assert same["greedy"] == 1.0 and same["sampled"] == pytest.approx(1.0, abs=1e-4)


def test_save_pair_roundtrip(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target_dir, draft_dir = ttp.save_pair(tmp_path)
    for d in (target_dir, draft_dir):
        for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer_config.json"):
            assert (d / name).is_file()
        model = AutoModelForCausalLM.from_pretrained(str(d))
        assert model.dtype == torch.bfloat16
        assert len(AutoTokenizer.from_pretrained(str(d))) == ttp.VOCAB_SIZE


# ---------------------------------------------------------------- shipped pair


def _load(kind):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = PAIR[kind]
    assert (path / "model.safetensors").is_file(), f"missing {path}; run scripts/train_tiny_pair.py"
    return AutoModelForCausalLM.from_pretrained(str(path)).eval(), AutoTokenizer.from_pretrained(str(path))


def test_shipped_pair_files_and_configs():
    from safetensors import safe_open

    configs = {}
    total = 0
    for kind, path in PAIR.items():
        for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer_config.json"):
            assert (path / name).is_file(), path / name
        configs[kind] = json.loads((path / "config.json").read_text())
        gen = json.loads((path / "generation_config.json").read_text())
        assert gen["eos_token_id"] == 1 and gen["pad_token_id"] == 0
        with safe_open(str(path / "model.safetensors"), "pt") as f:
            for key in f.keys():
                assert f.get_slice(key).get_dtype() == "BF16", key
        total += (path / "model.safetensors").stat().st_size
    assert total <= 10_000_000
    t, d = configs["target"], configs["draft"]
    assert t["vocab_size"] == d["vocab_size"] >= ttp.VOCAB_SIZE
    for cfg in (t, d):
        assert cfg["model_type"] == "llama"
        assert cfg["max_position_embeddings"] == 2048
        assert cfg["eos_token_id"] == 1 and cfg["pad_token_id"] == 0
        assert cfg.get("dtype", cfg.get("torch_dtype")) == "bfloat16"
    assert t["num_hidden_layers"] * t["hidden_size"] > d["num_hidden_layers"] * d["hidden_size"]
    assert (MODELS / "README.md").is_file()


@pytest.mark.parametrize("kind", ["target", "draft"])
def test_shipped_model_tokenizes_and_generates(kind):
    model, tok = _load(kind)
    prompt = "def f(x):"
    enc = tok(prompt, return_tensors="pt", add_special_tokens=False)
    assert enc.input_ids[0].tolist() == [b + 3 for b in prompt.encode()]
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=8, do_sample=False)
    new = out[0, enc.input_ids.shape[1] :]
    assert 1 <= new.numel() <= 8
    assert int(new.max()) < model.config.vocab_size
    text = tok.decode(new, skip_special_tokens=True)
    assert isinstance(text, str)
    assert tok.decode(out[0], skip_special_tokens=True).startswith(prompt)


def test_shipped_target_beats_draft_on_held_out(corpus):
    _, eval_bytes = corpus
    target, _ = _load("target")
    draft, _ = _load("draft")
    target, draft = target.float(), draft.float()
    bt = ttp.evaluate_bits_per_byte(target, eval_bytes, max_windows=8)
    bd = ttp.evaluate_bits_per_byte(draft, eval_bytes, max_windows=8)
    assert bt < bd < 5.0
