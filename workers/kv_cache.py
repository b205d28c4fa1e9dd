"""A worker's paged KV cache: per-layer slot tensors plus the worker's own BlockManager."""

from __future__ import annotations

import torch

from scheduler.block_manager import BlockManager
from scheduler.messages import StepPlan


def kv_shape(config) -> tuple[int, int, int]:
    heads = config.num_attention_heads
    kvh = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return config.num_hidden_layers, kvh, head_dim


def default_num_blocks(config, block_size: int, dtype: torch.dtype, device: torch.device,
                       max_model_len: int, max_num_seqs: int) -> int:
    """Enough blocks for every sequence at full length, capped by a memory budget:
    half the free memory on CUDA, 2 GiB on CPU."""
    layers, kvh, head_dim = kv_shape(config)
    per_block = 2 * layers * block_size * kvh * head_dim * torch.tensor([], dtype=dtype).element_size()
    useful = max_num_seqs * -(-(max_model_len + 1) // block_size)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budget = free // 2
    else:
        budget = 2 * 1024**3
    return max(1, min(useful, budget // per_block))


class StaleCacheError(RuntimeError):
    """The driver counts cached tokens this worker does not hold (it restarted empty)."""


class KVCache:
    def __init__(self, config, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device):
        layers, kvh, head_dim = kv_shape(config)
        self.block_size = block_size
        self.blocks = BlockManager(num_blocks, block_size)
        slots = num_blocks * block_size
        self.layers = [(torch.zeros(slots, kvh, head_dim, dtype=dtype, device=device),
                        torch.zeros(slots, kvh, head_dim, dtype=dtype, device=device)) for _ in range(layers)]

    def apply(self, plan: StepPlan) -> None:
        """Frees first, then each sequence's pool is resized to the slots the driver
        reserved (truncation drops rejected lookahead, growth makes room for this step)."""
        for sid in plan.free_seq_ids:
            self.blocks.free(sid)
        for sid, computed, slots in zip(plan.seq_ids, plan.num_computed, plan.num_slots):
            if computed > self.blocks.num_slots(sid):
                raise StaleCacheError(f"sequence {sid}: the driver counts {computed} cached tokens, "
                                   f"this worker holds {self.blocks.num_slots(sid)} slots (restarted?)")
            self.blocks.truncate(sid, slots)
            if not self.blocks.allocate(sid, slots):
                raise RuntimeError(f"KV pool out of blocks for sequence {sid} ({slots} slots): "
                                   "the driver's mirror disagrees with this worker")

    def tables(self, seq_ids: list[int]) -> list[list[int]]:
        return [self.blocks.block_table(s) for s in seq_ids]
