"""An EAGLE-3 head's forward over its own paged KV cache.

The head is one Llama decoder layer whose attention reads twice the hidden size::

    h        = fc(aux)                 on rows rebuilt from the target's hidden states [T, H]
             = the head's own prenorm  on rows drafted from its own guesses
    x        = [input_layernorm(embed(token)) ; hidden_norm(h)]                        [T, 2H]
    residual = h  (hidden_norm(h) with norm_before_residual)
    residual = residual + o_proj(attention(q, k, v of x; RoPE at the row's position))
    prenorm  = residual + mlp(post_attention_layernorm(residual))                      [T, H]
    logits   = lm_head(norm(prenorm))                                                  [T, draft_vocab]

The row at position q carries token q + 1 (it predicts token q + 2). Its K/V live in a
cache of one layer laid out like the target's (same block size, same block tables, one
slot per target position), so the target's reservation covers the head's writes and
``paged_attention.attend`` serves both. Weights are fused and transposed at load as in
the native executor (``llama_model``); the head runs in the target's dtype and device,
with its own RoPE settings (a head's config may differ from its target's).

``to_target(logits)`` scatters draft-vocabulary logits into the target vocabulary, -inf
elsewhere: the distribution the head proposes from, which the rejection sampler reads.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specray.workers import transformers_import
from specray.workers.eagle3_loader import Eagle3Checkpoint
from specray.workers.llama_model import rms_norm
from specray.workers.paged_attention import AttentionMetadata, attend
from specray.workers.rotary import STATIC_ROPE_TYPES, RotaryTable, apply_rotary, rope_type

# What a head's config may set of its RoPE: the rest of LlamaConfig is the head's shape.
_ROPE_KEYS = ("rope_theta", "rope_scaling", "rope_parameters", "max_position_embeddings", "partial_rotary_factor")


class Eagle3Head:
    def __init__(self, ckpt: Eagle3Checkpoint, embed: torch.Tensor, max_len: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        """``embed``: the target's embedding [V, H], used where the checkpoint has none;
        ``max_len``: the longest sequence (the target's window)."""
        w = {k: v.to(device=device, dtype=dtype) for k, v in ckpt.weights.items() if k not in ("d2t", "t2d")}
        t = lambda name: w[name].t().contiguous()   # noqa: E731  [out, in] -> [in, out], as llama_model
        self.eps = ckpt.rms_norm_eps
        self.heads, self.kv_heads, self.head_dim = ckpt.num_heads, ckpt.num_kv_heads, ckpt.head_dim
        self.hidden_size = ckpt.hidden_size
        self.norm_before_residual = ckpt.norm_before_residual
        self._own_embed = "embed_tokens.weight" in w
        self.embed = w["embed_tokens.weight"] if self._own_embed else embed.to(device=device, dtype=dtype)  # [V, H]
        self.fc = t("fc.weight")                                                             # [n * H_t, H]
        m = "midlayer."
        self.ln_embed = w[m + "input_layernorm.weight"]
        self.ln_hidden = w[m + "hidden_norm.weight"]
        self.qkv = torch.cat([t(m + f"self_attn.{x}_proj.weight") for x in "qkv"], dim=1)   # [2H, (h + 2 kvh) D]
        self.o = t(m + "self_attn.o_proj.weight")
        self.ln_post = w[m + "post_attention_layernorm.weight"]
        self.gate_up = torch.cat([t(m + "mlp.gate_proj.weight"), t(m + "mlp.up_proj.weight")], dim=1)
        self.down = t(m + "mlp.down_proj.weight")
        self.inter = ckpt.intermediate_size
        self.norm = w["norm.weight"]
        self.lm_head = t("lm_head.weight")                                                   # [H, draft_vocab]
        self.scaling = self.head_dim ** -0.5
        self.target_ids = ckpt.target_ids.to(device)                                         # [draft_vocab]
        self.target_vocab = ckpt.vocab_size
        self.rotary = RotaryTable(_rotary_config(ckpt), max_len + 1, dtype, device)
        self.q_size, self.kv_size = self.heads * self.head_dim, self.kv_heads * self.head_dim
        self.kv: list[tuple[torch.Tensor, torch.Tensor]] = []       # one layer: [slots, KVH, D] each

    def allocate(self, num_slots: int) -> None:
        """The head's K/V cache, one slot per slot of the target's cache."""
        dtype, dev = self.embed.dtype, self.embed.device
        shape = (num_slots, self.kv_heads, self.head_dim)
        self.kv = [(torch.zeros(shape, dtype=dtype, device=dev), torch.zeros(shape, dtype=dtype, device=dev))]

    @property
    def num_slots(self) -> int:
        return self.kv[0][0].shape[0] if self.kv else 0

    @property
    def nbytes(self) -> int:
        """Bytes of the head's own weights (the target's embedding, shared, not counted)."""
        own = [self.fc, self.ln_embed, self.ln_hidden, self.qkv, self.o, self.ln_post, self.gate_up, self.down,
               self.norm, self.lm_head] + ([self.embed] if self._own_embed else [])
        return sum(t.numel() * t.element_size() for t in own)

    def block_bytes(self, block_size: int) -> int:
        """Bytes one block of the head's cache takes (K and V)."""
        return 2 * block_size * self.kv_size * self.embed.element_size()

    def combine(self, aux: torch.Tensor) -> torch.Tensor:
        """The target's hidden states [T, n * H_t], concatenated in layer order -> [T, H]."""
        return torch.matmul(aux.to(self.fc.dtype), self.fc)

    def forward(self, token_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """token_ids [T] (target ids), hidden [T, H], positions [T] -> prenorm [T, H].
        Writes the rows' K/V at ``meta.slot_mapping`` (``meta.kv_caches`` is ``self.kv``)."""
        t = token_ids.shape[0]
        e = F.embedding(token_ids, self.embed)
        x = torch.cat([rms_norm(e, self.ln_embed, self.eps), rms_norm(hidden, self.ln_hidden, self.eps)], dim=-1)
        residual = x[:, self.hidden_size:] if self.norm_before_residual else hidden
        qkv = torch.matmul(x, self.qkv)
        qk = qkv[:, :self.q_size + self.kv_size].view(t, self.heads + self.kv_heads, self.head_dim)
        v = qkv[:, self.q_size + self.kv_size:].view(t, self.kv_heads, self.head_dim)
        cos, sin = self.rotary.cos_sin(positions)
        qk = apply_rotary(qk, cos, sin)
        o = attend(0, qk[:, :self.heads], qk[:, self.heads:], v, meta, self.scaling)
        residual = residual + torch.matmul(o.reshape(t, self.q_size), self.o)
        gu = torch.matmul(rms_norm(residual, self.ln_post, self.eps), self.gate_up)
        return residual + torch.matmul(F.silu(gu[:, :self.inter]) * gu[:, self.inter:], self.down)

    def logits(self, prenorm: torch.Tensor) -> torch.Tensor:
        """prenorm [m, H] -> draft-vocabulary logits [m, draft_vocab], float32."""
        return torch.matmul(rms_norm(prenorm, self.norm, self.eps), self.lm_head).float()

    def to_target(self, logits: torch.Tensor) -> torch.Tensor:
        """[m, draft_vocab] -> [m, V_target]: each draft id's logit at its target id, -inf
        at ids the head cannot propose."""
        full = logits.new_full((logits.shape[0], self.target_vocab), float("-inf"))
        return full.index_copy_(1, self.target_ids, logits)


def _rotary_config(ckpt: Eagle3Checkpoint):
    """A transformers config of the head's RoPE settings (its config's, not the target's),
    so every static rope type is computed as transformers' rotary module computes it."""
    # Imported here, not at module level: every target worker imports this module, and
    # transformers is seconds of its start; only a worker that loads a head needs it.
    llama_config = transformers_import.attr("transformers", "LlamaConfig")
    conf = {k: ckpt.config[k] for k in _ROPE_KEYS if k in ckpt.config}
    cfg = llama_config(hidden_size=ckpt.hidden_size, num_attention_heads=ckpt.num_heads,
                       num_key_value_heads=ckpt.num_kv_heads, head_dim=ckpt.head_dim, num_hidden_layers=1, **conf)
    rt = rope_type(cfg)
    if rt not in STATIC_ROPE_TYPES:
        raise ValueError(f"{ckpt.path}: rope_scaling type {rt!r} changes with the sequence length; an EAGLE-3 head "
                         f"here takes one of {', '.join(STATIC_ROPE_TYPES)}")
    return cfg
