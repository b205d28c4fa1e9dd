"""Shared fixtures for the worker tests: tiny random checkpoints saved to disk (loaded through
the workers' real loading path), the plain Hugging Face reference model, and a StepPlan builder.

Random tiny models are initialised with a large ``initializer_range`` so their logits are
spread out: greedy comparisons then never hinge on near-ties below float32 noise.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

from specray.scheduler.messages import StepPlan

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


def make_plan(seq_ids, num_computed, num_new, token_ids, num_slots, *, width=0, proposal_lens=None,
              proposal_token_ids=None, draft_rows=None, temperature=None, top_k=None, top_p=None,
              seeds=None, logprobs=None, free_seq_ids=(), step_id=0) -> StepPlan:
    """A StepPlan the way the driver fills it; per-sequence knobs default to greedy/off."""
    n = len(seq_ids)
    plan = StepPlan(step_id=step_id, width=width, seq_ids=list(seq_ids), num_computed=list(num_computed),
                    num_new=list(num_new), token_ids=list(token_ids), num_slots=list(num_slots),
                    proposal_lens=list(proposal_lens) if proposal_lens is not None else [0] * n,
                    proposal_token_ids=list(proposal_token_ids or []),
                    draft_rows=list(draft_rows) if draft_rows is not None else ([-1] * n if proposal_token_ids else []),
                    temperature=list(temperature) if temperature is not None else [0.0] * n,
                    top_k=list(top_k) if top_k is not None else [0] * n,
                    top_p=list(top_p) if top_p is not None else [1.0] * n,
                    seeds=list(seeds) if seeds is not None else [0] * n,
                    logprobs=list(logprobs) if logprobs is not None else [],
                    free_seq_ids=list(free_seq_ids))
    plan.validate()
    return plan


@pytest.fixture(scope="session")
def plan_builder():
    return make_plan


@pytest.fixture(scope="session")
def hf_ref():
    """The reference helpers as a namespace (tests import nothing from conftest)."""
    class Ref:
        logits = staticmethod(hf_logits)
        greedy = staticmethod(hf_greedy)
    return Ref
