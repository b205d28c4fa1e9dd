"""Shared fixtures for the worker tests: tiny random checkpoints saved to disk (loaded through
the workers' real loading path), the plain Hugging Face reference model, and a StepPlan builder.

Random tiny models are initialised with a large ``initializer_range`` so their logits are
spread out: greedy comparisons then never hinge on near-ties below float32 noise.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

VOCAB = 96

_BASE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
             initializer_range=0.25, tie_word_embeddings=False)
_CONFIGS = {"llama": LlamaConfig, "qwen2": Qwen2Config, "mistral": MistralConfig, "qwen3": Qwen3Config}


def _build(path, kind: str, seed: int, overrides: dict) -> None:
    cfg = _CONFIGS[kind](**{**_BASE, **overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg).float().eval()
    model.save_pretrained(path)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """``tiny_model(kind="llama", seed=0, **config_overrides) -> str`` (a checkpoint dir)."""
    cache: dict = {}

    def make(kind: str = "llama", seed: int = 0, **overrides) -> str:
        key = (kind, seed, repr(sorted(overrides.items())))
        if key not in cache:
            path = tmp_path_factory.mktemp(f"{kind}_{seed}")
            _build(path, kind, seed, overrides)
            cache[key] = str(path)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def hf_model():
    """``hf_model(path) -> model``: the plain transformers model in float32 (cached)."""
    cache: dict = {}

    def load(path: str):
        if path not in cache:
            cache[path] = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        return cache[path]

    return load


@torch.inference_mode()
def hf_logits(model, tokens: list[int]) -> torch.Tensor:
    """Logits [len(tokens), V] of the plain model over the whole sequence (explicit mask:
    token 0 may be the pad id)."""
    ids = torch.tensor([tokens])
    return model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0].float()


@torch.inference_mode()
def hf_greedy(model, tokens: list[int], n: int) -> list[int]:
    """Plain greedy continuation of ``tokens`` for ``n`` tokens (full forward each time)."""
    seq = list(tokens)
    for _ in range(n):
        seq.append(int(hf_logits(model, seq)[-1].argmax()))
    return seq[len(tokens):]


@pytest.fixture(scope="session")
def hf_ref():
    """The reference helpers as a namespace (tests import nothing from conftest)."""
    class Ref:
        logits = staticmethod(hf_logits)
        greedy = staticmethod(hf_greedy)
    return Ref
