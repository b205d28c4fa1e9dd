"""Attention over a paged KV cache for packed, variable-length batches.

The model runs with its own transformers code; only the attention function is ours,
registered through ``AttentionInterface``. The packed batch is passed as one sequence
(``[1, T]`` with explicit ``position_ids``); per-sequence structure travels in
``AttentionMetadata`` as an explicit keyword argument of the model call.

Layout, block_size = 4, two sequences (s0: 5 cached + 2 new, s1: 0 cached + 3 new)::

    packed tokens   T = 5:   s0:p5 s0:p6 s1:p0 s1:p1 s1:p2
    slot_mapping:            where each new token's K/V is written
    ctx_slots [n, Lmax=7]:   s0: slots of positions 0..6     s1: 0..2 then padding
    q_index   [T]:           row of each token in the padded [n * Qmax] query layout

Each layer writes the new K/V into the cache, gathers every sequence's context into a
padded ``[n, Lmax]`` view and runs one masked SDPA for the whole batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

ATTENTION_NAME = "specray_paged"
_HAS_GQA = "enable_gqa" in (F.scaled_dot_product_attention.__doc__ or "")


@dataclass
class AttentionMetadata:
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]   # per layer: [num_slots, KVH, D] each
    slot_mapping: torch.Tensor     # [T] long
    ctx_slots: torch.Tensor        # [n, Lmax] long
    q_index: torch.Tensor          # [T] long, into [n * Qmax]
    q_positions: torch.Tensor      # [n, Qmax] long (padding rows hold 0: they see key 0 only)
    num_seqs: int
    max_query_len: int

    def mask(self, sliding_window: int | None) -> torch.Tensor:
        key_pos = torch.arange(self.ctx_slots.shape[1], device=self.ctx_slots.device)
        q = self.q_positions.unsqueeze(-1)                                  # [n, Qmax, 1]
        m = key_pos <= q                                                    # [n, Qmax, Lmax]
        if sliding_window:
            m &= key_pos > q - sliding_window
        return m.unsqueeze(1)                                               # [n, 1, Qmax, Lmax]


def build_metadata(kv_caches, block_tables: list[list[int]], num_computed: list[int], num_new: list[int],
                   block_size: int, device: torch.device) -> tuple[AttentionMetadata, torch.Tensor]:
    """Host-side construction of one forward's metadata; returns it and positions [T]."""
    n = len(num_new)
    ctx_lens = [c + f for c, f in zip(num_computed, num_new)]
    lmax = max(ctx_lens)
    qmax = max(num_new)
    width = max(len(t) for t in block_tables)
    tables = torch.zeros(n, width, dtype=torch.long)
    for i, t in enumerate(block_tables):
        tables[i, :len(t)] = torch.tensor(t, dtype=torch.long)
    pos = torch.arange(lmax)
    valid = pos < torch.tensor(ctx_lens).unsqueeze(-1)                       # [n, Lmax]
    blk = (pos // block_size).clamp(max=width - 1).expand(n, lmax)
    ctx_slots = tables.gather(1, blk) * block_size + pos % block_size
    ctx_slots = torch.where(valid, ctx_slots, torch.zeros_like(ctx_slots))

    starts = torch.tensor(num_computed)
    lens = torch.tensor(num_new)
    offs = torch.arange(qmax)
    q_valid = offs < lens.unsqueeze(-1)                                     # [n, Qmax]
    q_positions = torch.where(q_valid, starts.unsqueeze(-1) + offs, torch.zeros_like(offs))
    q_index = torch.arange(n * qmax).view(n, qmax)[q_valid]                 # [T]
    positions = q_positions[q_valid]                                        # [T]
    seq_of = torch.arange(n).unsqueeze(-1).expand(n, qmax)[q_valid]
    slot_mapping = ctx_slots[seq_of, positions]

    def dev(x):
        return x.to(device, non_blocking=True)

    meta = AttentionMetadata(kv_caches, dev(slot_mapping), dev(ctx_slots), dev(q_index), dev(q_positions), n, qmax)
    return meta, dev(positions)


def paged_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                    specray_meta: AttentionMetadata | None = None, sliding_window=None, **kwargs):
    """query [1, H, T, D], key/value [1, KVH, T, D] (RoPE applied) -> ([1, T, H, D], None)."""
    meta = specray_meta
    if meta is None:
        raise RuntimeError("specray paged attention called without specray_meta")
    unsupported = [name for name in ("softcap", "s_aux", "sinks") if kwargs.get(name) is not None]
    if unsupported:
        # Silently ignoring these would give wrong outputs (e.g. Gemma 2's logit softcap).
        raise ValueError(f"specray paged attention does not support {', '.join(unsupported)} "
                                  f"({type(module).__name__})")
    k_cache, v_cache = meta.kv_caches[module.layer_idx]
    k_cache.index_copy_(0, meta.slot_mapping, key[0].transpose(0, 1).to(k_cache.dtype))
    v_cache.index_copy_(0, meta.slot_mapping, value[0].transpose(0, 1).to(v_cache.dtype))

    n, qmax = meta.num_seqs, meta.max_query_len
    _, heads, t, d = query.shape
    kvh = key.shape[1]
    q = query[0].transpose(0, 1)                                            # [T, H, D]
    q_pad = q.new_zeros(n * qmax, heads, d)
    q_pad[meta.q_index] = q
    q_pad = q_pad.view(n, qmax, heads, d).transpose(1, 2)                   # [n, H, Qmax, D]
    k_ctx = k_cache[meta.ctx_slots].transpose(1, 2).to(q.dtype)             # [n, KVH, Lmax, D]
    v_ctx = v_cache[meta.ctx_slots].transpose(1, 2).to(q.dtype)
    mask = meta.mask(sliding_window)
    if kvh != heads and not _HAS_GQA:
        k_ctx = k_ctx.repeat_interleave(heads // kvh, dim=1)
        v_ctx = v_ctx.repeat_interleave(heads // kvh, dim=1)
    extra = {"enable_gqa": True} if kvh != heads and _HAS_GQA else {}
    out = F.scaled_dot_product_attention(q_pad, k_ctx, v_ctx, attn_mask=mask, scale=scaling, **extra)
    out = out.transpose(1, 2).reshape(n * qmax, heads, d)[meta.q_index]     # [T, H, D]
    return out.unsqueeze(0), None


def register() -> str:
    AttentionInterface.register(ATTENTION_NAME, paged_attention)
    return ATTENTION_NAME
