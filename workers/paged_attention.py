"""Attention over a paged KV cache for packed, variable-length batches.

``attend`` takes packed ``[T, heads, D]`` tensors: the native executor
(``llama_model``) calls it directly. A model on the transformers path reaches it through
``paged_attention``, registered with ``AttentionInterface``: the packed batch is passed as
one sequence (``[1, T]`` with explicit ``position_ids``) and per-sequence structure
travels in ``AttentionMetadata`` as an explicit keyword argument of the model call.

Layout, block_size = 4, two sequences (s0: 5 cached + 2 new, s1: 0 cached + 3 new)::

    packed tokens   T = 5:   s0:p5 s0:p6 s1:p0 s1:p1 s1:p2
    slot_mapping:            where each new token's K/V is written
    block_index [n * W=2]:   s0: its blocks 0..1   s1: its block 0, then padding (block 0)
    q_positions [n, Qmax=3]: s0: 5 6 6   s1: 0 1 2   (padding repeats the last real row)
    q_src [n * Qmax]:        packed token of each padded query row: 0 1 1 2 3 4
    q_index [T]:             padded row of each packed token:       0 1 3 4 5

Each layer writes the new K/V into the cache, gathers every sequence's whole blocks into
a padded ``[n, W * block_size]`` context and runs one masked SDPA for the whole batch
(a batch with nothing cached attends over its own K/V instead). A ragged batch whose
padding would cost more than half again its query rows (a prompt chunk among decoding
sequences) attends in parts, each padded to its own longest query and widest context
(``attention_parts``); the K/V writes and every other layer stay packed. Grouped-query attention
with a mask folds each KV head's query heads into one longer query, so no K/V is copied and
SDPA's fused kernels apply (see ``attend``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from specray.scheduler.block_manager import blocks_needed
from specray.workers.host_copy import to_device

ATTENTION_NAME = "specray_paged"
_HAS_GQA = "enable_gqa" in (F.scaled_dot_product_attention.__doc__ or "")


@dataclass
class AttentionMetadata:
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]   # per layer: [num_slots, KVH, D] each
    block_size: int
    slot_mapping: torch.Tensor     # [T] long
    block_index: torch.Tensor      # [n * W] long: each sequence's first W blocks, padded with block 0
    q_positions: torch.Tensor      # [n, Qmax] long
    q_src: torch.Tensor | None     # [n * Qmax] long; None when every sequence feeds Qmax tokens
    q_index: torch.Tensor | None   # [T] long; None with q_src
    num_seqs: int
    max_query_len: int
    prefill: bool                  # nothing cached: the step's own K/V are the whole context
    # Set where padding every sequence to the longest query would cost more than half
    # again the attention's rows: each part attends on its own (its packed rows, its metadata).
    parts: list[tuple[torch.Tensor, AttentionMetadata]] | None = None
    _masks: dict = field(default_factory=dict, repr=False)
    _context: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)

    @property
    def context_len(self) -> int:
        if self.prefill:
            return self.max_query_len
        return self.block_index.numel() // self.num_seqs * self.block_size

    def mask(self, sliding_window: int | None, dtype: torch.dtype, groups: int = 1) -> torch.Tensor:
        """Additive [n, 1, groups * Qmax, context_len] mask (row ``g * Qmax + j`` is query row
        j's, see ``attend``), built by the first layer that asks: layers differ at most in
        their window. Causality alone hides the keys past each sequence's context (padding
        keys, stale slots); padding query rows repeat a real row, so no row is fully masked
        (SDPA would give NaN)."""
        key = (sliding_window, dtype, groups)
        if key not in self._masks and groups > 1:
            self._masks[key] = self.mask(sliding_window, dtype).repeat(1, 1, groups, 1)
        if key not in self._masks:
            key_pos = torch.arange(self.context_len, device=self.q_positions.device)
            q = self.q_positions.unsqueeze(-1)                              # [n, Qmax, 1]
            hidden = key_pos > q
            if sliding_window:
                hidden |= key_pos <= q - sliding_window
            zeros = torch.zeros(hidden.shape, dtype=dtype, device=hidden.device)
            self._masks[key] = zeros.masked_fill_(hidden, float("-inf")).unsqueeze(1)
        return self._masks[key]

    def context_buffers(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V gather targets [n * W, block_size, KVH, D], shared by the layers (each is
        done with them before the next one runs): fresh multi-MB CPU buffers per layer cost
        more in page faults than the gather itself."""
        if self._context is None:
            shape = (self.block_index.numel(), self.block_size, *like.shape[1:])
            self._context = (like.new_empty(shape), like.new_empty(shape))
        return self._context


def slot_mapping(block_index: torch.Tensor, q_pos: torch.Tensor, width: int, block_size: int) -> torch.Tensor:
    """The cache slot [n * Qmax] of each padded query row, from the block index [n * W]
    and the query positions [n, Qmax] (device ops only: CUDA graphs capture it)."""
    n = q_pos.shape[0]
    return (block_index.view(n, width).gather(1, q_pos // block_size) * block_size + q_pos % block_size).view(-1)


def block_rows(block_tables: list[list[int]], width: int) -> list[int]:
    """Each table's first ``width`` blocks, padded with block 0 (hidden by causality): the
    flat block index [n * W]."""
    blocks: list[int] = []
    for table in block_tables:
        row = table[:width]
        blocks += row
        blocks += [0] * (width - len(row))
    return blocks


def attention_parts(num_new: list[int]) -> list[list[int]]:
    """Sequences grouped so that each group's padded query rows (its size times its longest
    query) are at most 1.5 times its real rows, longest queries first: one long prompt chunk
    among decoding sequences would otherwise pad every one of them to the chunk's length
    (and to its context's width)."""
    order = sorted(range(len(num_new)), key=lambda i: -num_new[i])
    parts: list[list[int]] = []
    for i in order:
        if parts:
            part = parts[-1]
            qmax, real = num_new[part[0]], sum(num_new[j] for j in part)
            if 2 * (len(part) + 1) * qmax <= 3 * (real + num_new[i]):
                part.append(i)
                continue
        parts.append([i])
    return [sorted(part) for part in parts]


def build_metadata(kv_caches, block_tables: list[list[int]], num_computed: list[int], num_new: list[int],
                   block_size: int, device: torch.device, split: bool = True) -> tuple[AttentionMetadata, torch.Tensor]:
    """Host-side construction of one forward's metadata; returns it and positions [T].
    ``split=False``: one padded batch, never ``parts`` (a part's own metadata is built so)."""
    n = len(num_new)
    qmax = max(num_new)
    width = blocks_needed(max(c + q for c, q in zip(num_computed, num_new)), block_size)
    ragged = min(num_new) != qmax
    # Per-token lists only through range/list concatenation (C speed), then one host
    # tensor and one copy to the device.
    blocks = block_rows(block_tables, width)
    q_positions, q_src, q_index = [], [], []
    packed_start = 0
    for i, (start, q) in enumerate(zip(num_computed, num_new)):
        q_positions += range(start, start + q)
        if ragged:
            q_positions += [start + q - 1] * (qmax - q)
            q_src += range(packed_start, packed_start + q)
            q_src += [packed_start + q - 1] * (qmax - q)
            q_index += range(i * qmax, i * qmax + q)
            packed_start += q
    ints = to_device(blocks + q_positions + q_src + q_index, device)
    block_index, q_pos, q_src_t, q_index_t = ints.split([len(blocks), n * qmax, len(q_src), len(q_index)])
    q_pos = q_pos.view(n, qmax)
    positions, slots = q_pos.view(-1), slot_mapping(block_index, q_pos, width, block_size)
    if ragged:
        positions, slots = positions.index_select(0, q_index_t), slots.index_select(0, q_index_t)
    else:
        q_src_t = q_index_t = None
    meta = AttentionMetadata(kv_caches, block_size, slots, block_index, q_pos, q_src_t, q_index_t,
                             n, qmax, prefill=not any(num_computed))
    groups = attention_parts(num_new) if split and ragged else []
    if len(groups) > 1:
        starts = [0]
        for q in num_new:
            starts.append(starts[-1] + q)
        meta.parts = []
        for g in groups:
            rows = to_device([r for i in g for r in range(starts[i], starts[i + 1])], device)
            sub, _ = build_metadata(kv_caches, [block_tables[i] for i in g], [num_computed[i] for i in g],
                                    [num_new[i] for i in g], block_size, device, split=False)
            meta.parts.append((rows, sub))
    return meta, positions


@dataclass
class QueryTail:
    """The last ``counts[i]`` fed rows of each sequence as a step of their own over the same
    cache (their K/V, and everything before them, written by the full step): what a
    forward's last layer still has to compute when only those rows' logits are wanted."""

    meta: AttentionMetadata
    rows: torch.Tensor            # [R] the full step's packed rows, in tail order
    logits_index: torch.Tensor    # [m] the wanted rows, as tail rows


def query_tail(kv_caches, block_tables: list[list[int]], num_computed: list[int], num_new: list[int],
               counts: list[int], logits_index: torch.Tensor, block_size: int, device: torch.device) -> QueryTail:
    """``counts[i]``: how many of sequence i's last fed rows ``logits_index`` draws from (0:
    none of them; the sequence is left out). Every wanted row must lie in a tail."""
    rows: list[int] = []
    tables, computed, tail = [], [], []
    end = 0
    for table, c, q, r in zip(block_tables, num_computed, num_new, counts):
        end += q
        if r > 0:
            rows += range(end - r, end)
            tables.append(table)
            computed.append(c + q - r)
            tail.append(r)
    meta, _ = build_metadata(kv_caches, tables, computed, tail, block_size, device)
    rows_t = to_device(rows, device)
    remap = torch.full((end,), -1, dtype=torch.long, device=device)
    remap[rows_t] = torch.arange(len(rows), device=device)
    return QueryTail(meta, rows_t, remap[logits_index])


def write_kv(layer: int, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> None:
    """k/v [T, KVH, D] into layer ``layer``'s cache at ``meta.slot_mapping``."""
    k_cache, v_cache = meta.kv_caches[layer]
    k_cache.index_copy_(0, meta.slot_mapping, k.to(k_cache.dtype))
    v_cache.index_copy_(0, meta.slot_mapping, v.to(v_cache.dtype))


def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
           scaling: float | None, sliding_window: int | None = None, write: bool = True) -> torch.Tensor:
    """Packed attention for layer ``layer``: q [T, H, D], k/v [T, KVH, D] (RoPE applied)
    -> [T, H, D]. Writes k/v into the layer's cache at ``meta.slot_mapping`` first, unless
    ``write`` is False (the caller has written them)."""
    if write:
        write_kv(layer, k, v, meta)
    if meta.parts is not None:
        out = q.new_empty(q.shape)
        for rows, sub in meta.parts:
            part = attend(layer, q.index_select(0, rows), k.index_select(0, rows), v.index_select(0, rows), sub,
                          scaling, sliding_window, write=False)
            out.index_copy_(0, rows, part)
        return out
    k_cache, v_cache = meta.kv_caches[layer]

    n, qmax = meta.num_seqs, meta.max_query_len
    heads, d = q.shape[1:]
    kvh = k.shape[1]

    def padded(x):                                                          # [T, h, D] -> [n, h, Qmax, D]
        if meta.q_src is not None:
            x = x.index_select(0, meta.q_src)
        return x.reshape(n, qmax, x.shape[1], d).transpose(1, 2)

    def context(cache, buf):
        # Whole blocks: one contiguous copy per block instead of one per slot.
        torch.index_select(cache.view(-1, meta.block_size, kvh, d), 0, meta.block_index, out=buf)
        return buf.view(n, -1, kvh, d).transpose(1, 2).to(q.dtype)        # [n, KVH, W * bs, D]

    qp = padded(q)
    if meta.prefill:
        # Nothing cached: padded row j is position j of its sequence, so causal attention over
        # the step's own K/V is exact for every real row, with no gather and (unless there is
        # a window) no mask.
        k_ctx, v_ctx = padded(k), padded(v)
    else:
        k_ctx, v_ctx = map(context, (k_cache, v_cache), meta.context_buffers(k_cache))
    masked = bool(sliding_window) or not meta.prefill
    groups = heads // kvh
    extra = {}
    if kvh != heads and masked:
        # Grouped-query attention without copying K/V: the query heads of each KV head
        # (heads kv * groups .. kv * groups + groups - 1, as repeat_kv pairs them) become
        # one query of groups * Qmax rows, the mask repeated per group. SDPA then sees
        # plain multi-head attention with a mask, which its fused memory-efficient kernel
        # takes; enable_gqa with a mask leaves only the math kernel.
        qp = qp.reshape(n, kvh, groups * qmax, d)
    elif kvh != heads and _HAS_GQA:
        extra = {"enable_gqa": True}          # causal, no mask: the flash kernel takes GQA
    elif kvh != heads:
        k_ctx = k_ctx.repeat_interleave(groups, dim=1)
        v_ctx = v_ctx.repeat_interleave(groups, dim=1)
    mask = meta.mask(sliding_window, qp.dtype, groups if kvh != heads else 1) if masked else None
    out = F.scaled_dot_product_attention(qp, k_ctx, v_ctx, attn_mask=mask, is_causal=mask is None,
                                         scale=scaling, **extra)
    out = out.reshape(n, heads, qmax, d).transpose(1, 2).reshape(n * qmax, heads, d)
    if meta.q_index is not None:
        out = out.index_select(0, meta.q_index)
    return out


def paged_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                    specray_meta: AttentionMetadata | None = None, sliding_window=None, **kwargs):
    """transformers' attention interface: query [1, H, T, D], key/value [1, KVH, T, D]
    (RoPE applied) -> ([1, T, H, D], None), through ``attend``."""
    if specray_meta is None:
        raise RuntimeError("specray paged attention called without specray_meta")
    unsupported = [name for name in ("softcap", "s_aux", "sinks") if kwargs.get(name) is not None]
    if unsupported:
        # Silently ignoring these would give wrong outputs (e.g. Gemma 2's logit softcap).
        raise ValueError(f"specray paged attention does not support {', '.join(unsupported)} "
                                  f"({type(module).__name__})")
    packed = lambda x: x[0].transpose(0, 1)                                 # noqa: E731  [T, h, D]
    out = attend(module.layer_idx, packed(query), packed(key), packed(value), specray_meta, scaling,
                 sliding_window)
    return out.unsqueeze(0), None


def register() -> str:
    # Here, not at import: transformers' modeling code is imported only by the transformers path.
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, paged_attention)
    return ATTENTION_NAME
