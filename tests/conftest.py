"""Shared fixtures: tiny models saved with save_pretrained, and one private Ray per session."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def make_pair(out_dir: Path, arch: str = "llama", vocab: int = 97, hidden: int = 64, layers: int = 2,
              heads: int = 4, kv_heads: int = 2, max_len: int = 256, draft_max_len: int | None = None,
              seed: int = 0, draft_noise: float = 0.0):
    """A target and a draft sharing its embedding, first layer and head (so the draft
    agrees with the target often but not always); returns their directories."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    cfg_cls, model_cls = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}[arch]

    def config(n_layers, max_pos):
        return cfg_cls(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                       num_hidden_layers=n_layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                       max_position_embeddings=max_pos, bos_token_id=None, eos_token_id=None,
                       pad_token_id=None, tie_word_embeddings=False)

    torch.manual_seed(seed)
    target = model_cls(config(layers, max_len))
    with torch.no_grad():
        # Sharper logits than the default init make greedy choices robust to float noise.
        target.lm_head.weight.mul_(8.0)
        # Damp the layers the draft lacks, so it agrees with the target most of the time.
        for layer in target.model.layers[1:]:
            layer.self_attn.o_proj.weight.mul_(0.3)
            layer.mlp.down_proj.weight.mul_(0.3)
    draft = model_cls(config(1, draft_max_len or max_len))
    sd = {k: v for k, v in target.state_dict().items() if not k.startswith("model.layers.") or k.startswith("model.layers.0.")}
    draft.load_state_dict(sd)
    if draft_noise:
        with torch.no_grad():
            for p in draft.parameters():
                p.add_(torch.randn_like(p) * draft_noise)
    t_dir, d_dir = out_dir / f"{arch}-target", out_dir / f"{arch}-draft"
    target.save_pretrained(t_dir)
    draft.save_pretrained(d_dir)
    return str(t_dir), str(d_dir)


@pytest.fixture(scope="session")
def llama_pair(tmp_path_factory):
    return make_pair(tmp_path_factory.mktemp("llama"), "llama")


@pytest.fixture(scope="session")
def qwen2_pair(tmp_path_factory):
    return make_pair(tmp_path_factory.mktemp("qwen2"), "qwen2", kv_heads=1, seed=1)


@pytest.fixture(scope="session")
def ray_session():
    """One private Ray for the whole test session (starting one takes 8-15 s here)."""
    import ray

    tmp = tempfile.mkdtemp(prefix="srt", dir="/tmp")
    os.environ["RAY_TMPDIR"] = tmp
    ray.init(address="local", num_cpus=2, object_store_memory=150 * 1024 * 1024, include_dashboard=False,
             log_to_driver=False, _temp_dir=tmp)
    yield ray
    ray.shutdown()


def hf_greedy(model_dir: str, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """The reference: transformers' own generate(do_sample=False), one prompt at a time."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    outs = []
    for p in prompts:
        ids = torch.tensor([p])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, pad_token_id=0, eos_token_id=None)
        outs.append(out[0, len(p):].tolist())
    return outs
