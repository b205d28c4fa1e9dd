"""Rotary position embeddings as one table lookup per forward.

The inverse frequencies and the attention scaling are computed from the model's config
as transformers' rotary modules compute them: the default type by the same expression as
their ``compute_default_rope_parameters``, every other type by transformers' own
``ROPE_INIT_FUNCTIONS`` (Llama 3's ``llama3`` scaling, ``linear``, ``yarn``), which import
no modeling code. Static-frequency types only: a dynamic type (``dynamic``, ``longrope``
past the original length) changes its frequencies with the sequence length and is
refused, leaving the model on the transformers path.

Contract: ``RotaryTable(config, max_len, dtype, device)`` then ``cos_sin(positions)`` ->
(cos, sin), each [T, D] in ``dtype``; values equal transformers' ``cos.to(dtype)`` /
``sin.to(dtype)`` element for element (float32 angles, cast once).
"""

from __future__ import annotations

import torch

from specray.workers import transformers_import

STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def rope_type(config) -> str:
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    return params.get("rope_type", params.get("type", "default")) or "default"


def inverse_frequencies(config) -> tuple[torch.Tensor, float]:
    """(inv_freq [D / 2] float32, attention scaling), as the config's transformers rotary
    module holds them."""
    rt = rope_type(config)
    if rt not in STATIC_ROPE_TYPES:
        raise ValueError(f"rope_type {rt!r} changes with the sequence length")
    if rt != "default":
        init = transformers_import.attr("transformers.modeling_rope_utils", "ROPE_INIT_FUNCTIONS")[rt]
        inv_freq, scale = init(config)
        return inv_freq, float(scale)
    params = getattr(config, "rope_parameters", None) or {}
    base = params.get("rope_theta", getattr(config, "rope_theta", None))
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0


class RotaryTable:
    def __init__(self, config, max_len: int, dtype: torch.dtype, device: torch.device) -> None:
        inv_freq, scale = inverse_frequencies(config)
        inv_freq = inv_freq.to(device=device, dtype=torch.float32)
        pos = torch.arange(max_len, device=device, dtype=torch.float32)
        freqs = pos[:, None] * inv_freq[None, :]                   # same float32 product as HF
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = (emb.cos() * scale).to(dtype)
        self.sin = (emb.sin() * scale).to(dtype)
        # One gather for both: [max_len, 2, D].
        self.table = torch.stack((self.cos, self.sin), dim=1)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cs = self.table.index_select(0, positions)
        return cs[:, 0], cs[:, 1]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, h, D]; cos/sin [T, D]: x * cos + rotate_half(x) * sin, in x's dtype."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos.unsqueeze(1) + rotated * sin.unsqueeze(1)
