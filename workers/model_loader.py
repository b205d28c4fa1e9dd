"""Loading causal LMs and tokenizers through transformers' own path."""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from specray.workers import paged_attention

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
           "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {device!r}")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested but CUDA is not available")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device, config=None) -> torch.dtype:
    """'auto': the checkpoint's dtype on CUDA, float32 on CPU (half precision is slow there)."""
    if dtype == "auto":
        if device.type == "cpu":
            return torch.float32
        d = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
        if isinstance(d, str):
            d = _DTYPES.get(d)
        return d if d in (torch.float16, torch.bfloat16, torch.float32) else torch.bfloat16
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of auto, {', '.join(sorted(_DTYPES))}; got {dtype!r}")
    return _DTYPES[dtype]


def load_config(path: str):
    try:
        return AutoConfig.from_pretrained(path)
    except Exception as e:
        raise ValueError(f"cannot load a model config from {path!r}: {e}") from e


def load_model(path: str, dtype: str = "auto", device: str = "auto"):
    """Returns (model, config, device, dtype); the model attends over specray's paged cache."""
    dev = resolve_device(device)
    config = load_config(path)
    torch_dtype = resolve_dtype(dtype, dev, config)
    model = AutoModelForCausalLM.from_pretrained(path, config=config, dtype=torch_dtype)
    # The attention setting lives on the config: each model has its own config object.
    model.set_attn_implementation(paged_attention.register())
    model.to(dev).eval()
    return model, model.config, dev, torch_dtype


def load_tokenizer(path: str):
    return AutoTokenizer.from_pretrained(path)


def eos_token_ids(config) -> list[int]:
    gen = getattr(config, "eos_token_id", None)
    if gen is None:
        return []
    return list(gen) if isinstance(gen, (list, tuple)) else [int(gen)]


def max_model_len(config) -> int:
    return int(getattr(config, "max_position_embeddings", None) or 2048)
