"""A model's config read from its ``config.json`` alone, for the native executor.

Reading a config through transformers imports transformers and, through its config
classes' validators, ``torch.distributed.tensor``: about 2 s of CPU in every worker
process, more than loading a small model's weights. ``from_json(d)`` returns a
``NativeConfig`` only where ``config.json`` names, itself, every field the native executor
reads; it never fills in a family's default (those stay transformers'). Otherwise it
returns None and the caller reads the config through transformers
(``model_loader.load_config`` does both).

What the config classes derive from the fields, ``from_json`` derives the same way: a
null ``num_key_value_heads`` is the head count, a missing Llama or Mistral ``head_dim`` the
hidden size over the heads; ``rope_theta`` beside the fields (the older
layout) becomes ``rope_parameters``; a Qwen2/Qwen3 ``sliding_window`` counts only with
``use_sliding_window``. Only the default rotary type is read here (scaled types compute
their frequencies through transformers' functions, which take its config object).

A ``NativeConfig`` carries every field of the file as an attribute, as a transformers
config does, so ``getattr(config, name, default)`` reads both alike.
"""

from __future__ import annotations

from types import SimpleNamespace

# Read by the executor for every family; a file without one of them goes to transformers.
REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "hidden_act", "max_position_embeddings", "rms_norm_eps",
            "tie_word_embeddings", "eos_token_id")
# What each family reads besides: its windows.
FAMILY_REQUIRED = {
    "llama": (),
    "mistral": ("sliding_window",),
    "qwen2": ("use_sliding_window", "sliding_window", "layer_types"),
    "qwen3": ("use_sliding_window", "sliding_window", "layer_types", "head_dim"),
}
# Where a missing head_dim is the hidden size over the heads (Qwen2's config has no such
# field: its modules divide; Qwen3's default is a fixed 128, so it is required above).
_DERIVED_HEAD_DIM = ("llama", "mistral")
# Rotary keys the default type may carry; any other (a scaling factor, a partial rotary
# factor) sends the file to transformers.
_DEFAULT_ROPE_KEYS = {"rope_type", "type", "rope_theta"}


class NativeConfig(SimpleNamespace):
    """The fields of a ``config.json``, with what ``from_json`` derived."""


def from_json(d: dict) -> NativeConfig | None:
    """``d`` (a parsed ``config.json``) as a NativeConfig, or None where reading it needs
    transformers' config class (a family default, a scaled rotary type, another family)."""
    family = d.get("model_type")
    if family not in FAMILY_REQUIRED or any(k not in d for k in REQUIRED + FAMILY_REQUIRED[family]):
        return None
    if "partial_rotary_factor" in d or not isinstance(d.get("head_dim", 0), (int, type(None))):
        return None
    rope = _default_rope(d)
    if rope is None:
        return None
    fields = dict(d, rope_parameters=rope)
    fields.pop("rope_scaling", None)
    if fields["num_key_value_heads"] is None:
        fields["num_key_value_heads"] = fields["num_attention_heads"]
    if family in _DERIVED_HEAD_DIM and fields.get("head_dim") is None:
        fields["head_dim"] = fields["hidden_size"] // fields["num_attention_heads"]
    if family == "qwen3" and fields["head_dim"] is None:
        return None
    if family in ("qwen2", "qwen3"):
        types = fields["layer_types"]
        if not isinstance(types, list) or len(types) != fields["num_hidden_layers"]:
            return None
        if not fields["use_sliding_window"]:
            fields["sliding_window"] = None
    if "dtype" not in fields and "torch_dtype" in fields:
        fields["dtype"] = fields.pop("torch_dtype")
    return NativeConfig(**fields)


def _default_rope(d: dict) -> dict | None:
    """``rope_parameters`` of a file whose rotary type is the default, else None."""
    params = d.get("rope_parameters")
    if params is None:
        params = d.get("rope_scaling")
    if params is None:
        params = {}
    if not isinstance(params, dict) or set(params) - _DEFAULT_ROPE_KEYS:
        return None
    if params.get("rope_type", params.get("type", "default")) != "default":
        return None
    theta = params.get("rope_theta", d.get("rope_theta"))
    if not isinstance(theta, (int, float)) or isinstance(theta, bool):
        return None
    return {"rope_type": "default", "rope_theta": theta}
