"""Rotary position embeddings as one table lookup per forward.

The inverse frequencies and the attention scaling come from the checkpoint's own
transformers rotary module (so every ``rope_type`` it knows, Llama 3's ``llama3``
scaling included, is computed by the same code as the reference). Static-frequency
types only: a dynamic type (``dynamic``, ``longrope`` past the original length) changes
its frequencies with the sequence length and is refused, leaving the model on the
transformers path.

Contract: ``RotaryTable(rotary_module, max_len, dtype)`` then ``cos_sin(positions)`` ->
(cos, sin), each [T, D] in ``dtype``; values equal transformers' ``cos.to(dtype)`` /
``sin.to(dtype)`` element for element (float32 angles, cast once).
"""

from __future__ import annotations

import torch

STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def rope_type(config) -> str:
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    return params.get("rope_type", params.get("type", "default")) or "default"


class RotaryTable:
    def __init__(self, rotary_module, max_len: int, dtype: torch.dtype, device: torch.device) -> None:
        inv_freq = rotary_module.inv_freq.to(device=device, dtype=torch.float32)
        scale = float(getattr(rotary_module, "attention_scaling", 1.0))
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
