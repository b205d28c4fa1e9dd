"""Loading causal LMs and tokenizers.

A model the native executor runs (``llama_model.supports``) whose checkpoint is
safetensors is read directly (``load_weights``): its config from ``config.json`` where
that file says all the executor reads (``native_config``), its tensors through
safetensors, without importing transformers, which is most of a worker's start. Every
other model loads through transformers' own path (``load_model``).

A model is named by a local directory or a hub id. A name that can only be a path (see
``looks_local``) and does not exist is refused here, naming the absolute path it was
looked for at, instead of ending in a hub error about a repository id.
"""

from __future__ import annotations

import json
import os

import torch

from specray.workers import native_config, paged_attention, transformers_import
from specray.workers.model_files import looks_local, read_config, resolve_model_path  # noqa: F401 - their home for callers

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
    """The model's config: a ``NativeConfig`` where its ``config.json`` alone says all the
    native executor reads, else transformers' (``transformers_config``)."""
    config = native_config.from_json(read_config(path))
    return config if config is not None else transformers_config(path)


def transformers_config(path: str):
    """The model's config as transformers reads it (its family's defaults filled in)."""
    where = resolve_model_path(path)
    try:
        with transformers_import.LOCK:
            from transformers import AutoConfig

            return AutoConfig.from_pretrained(where)
    except Exception as e:
        if where == path and not os.path.isdir(path):
            # Not a directory here: transformers took it for a hub id.
            raise ValueError(f"cannot load a model config from {path!r}: it is neither a directory here "
                             f"(relative paths resolve from {os.getcwd()}) nor a model the hub or its cache "
                             f"holds: {e}") from e
        raise ValueError(f"cannot load a model config from {path!r}: {e}") from e


def safetensors_files(path: str) -> list[str] | None:
    """The checkpoint's safetensors files (one, or the shards its index names), or None
    where it has none (a ``.bin`` checkpoint, a hub id not in the local cache)."""
    where = resolve_model_path(path)
    if not os.path.isdir(where):
        try:
            from huggingface_hub import snapshot_download

            where = snapshot_download(where, allow_patterns=["*.json", "*.safetensors"], local_files_only=True)
        except Exception:  # noqa: BLE001 - not in the cache: transformers' path says why
            return None
    index = os.path.join(where, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        files = [os.path.join(where, s) for s in shards]
        return files if all(os.path.isfile(f) for f in files) else None
    single = os.path.join(where, "model.safetensors")
    return [single] if os.path.isfile(single) else None


def load_weights(files: list[str], dtype: torch.dtype, device: torch.device) -> dict[str, torch.Tensor]:
    """Every tensor of ``files`` by its checkpoint name, floating-point ones in ``dtype``,
    on ``device`` (as ``from_pretrained(dtype=...)`` holds them)."""
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in files:
        for name, t in load_file(f, device="cpu").items():
            out[name] = t.to(device=device, dtype=dtype if t.is_floating_point() else t.dtype)
    return out


def load_model(path: str, dtype: str = "auto", device: str = "auto", config=None):
    """Returns (model, config, device, dtype) through transformers; the model attends over
    specray's paged cache. ``config``: the model's transformers config, where the caller
    has read it already."""
    dev = resolve_device(device)
    if config is None or isinstance(config, native_config.NativeConfig):
        config = transformers_config(path)
    torch_dtype = resolve_dtype(dtype, dev, config)
    with transformers_import.LOCK:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(resolve_model_path(path), config=config, dtype=torch_dtype)
        # The attention setting lives on the config: each model has its own config object.
        model.set_attn_implementation(paged_attention.register())
        model.to(dev).eval()
    return model, model.config, dev, torch_dtype


def load_tokenizer(path: str):
    with transformers_import.LOCK:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(resolve_model_path(path))


def encode_prompt(tokenizer, text: str) -> list[int]:
    """``text`` as transformers' own generation path encodes a plain prompt
    (``tokenizer(text)``: whatever the tokenizer puts in front, a BOS from its
    post-processor or its ``add_bos_token``), without what it appends after the text (an
    EOS or SEP, as ByT5's does), which would end the request before it began."""
    full = tokenizer(text)["input_ids"]
    plain = tokenizer(text, add_special_tokens=False)["input_ids"]
    n = len(plain)
    if n:
        # full = prefix + plain + suffix; the prefix is a few special tokens at most.
        for i in range(len(full) - n + 1):
            if full[i:i + n] == plain:
                return full[:i + n]
    # No plain tokens to anchor on (or a tokenizer whose special tokens change the text's
    # own encoding): drop trailing end-of-sequence tokens.
    ends = {t for t in (tokenizer.eos_token_id, tokenizer.sep_token_id) if t is not None}
    bos = tokenizer.bos_token_id
    while full and full[-1] in ends and not (len(full) == 1 and full[0] == bos):
        full = full[:-1]
    return full


def encode_chat(tokenizer, messages: list[dict]) -> list[int]:
    """One conversation as transformers' ``apply_chat_template(messages,
    add_generation_prompt=True)`` tokenizes it: the template renders the text (its BOS
    included, where it writes one), which is then encoded without further special tokens.
    A tokenizer without a chat template is a ValueError."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("messages need a chat template, and the target's tokenizer has none "
                         "(set tokenizer.chat_template, or send a plain prompt)")
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception as e:  # noqa: BLE001 - a template's own refusal (jinja2's raise_exception) is bad input
        raise ValueError(f"messages: the chat template refused them: {e}") from None
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def eos_token_ids(config) -> list[int]:
    gen = getattr(config, "eos_token_id", None)
    if gen is None:
        return []
    return list(gen) if isinstance(gen, (list, tuple)) else [int(gen)]
