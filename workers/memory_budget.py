"""How many KV blocks workers take: their share of the device, less what they hold and
what their steps will need.

On CUDA a worker (or the workers of one process, sized together) holds at most ``share``
of the GPU's total memory (``CacheConfig.gpu_memory_utilization``, set per worker as vLLM
does, so that workers sharing a GPU do not each size against the same free memory)::

    KV bytes = share * total - held - reserve       (capped by free - reserve)
    held     = what each worker allocated loading its model, measured after the native
               executor made its copies and the transformers modules were dropped
    reserve  = what its steps will allocate: each worker's CUDA graph pool (the peak of
               its largest bucket: graphs are captured largest first into one pool, and
               later ones reuse that memory), plus the peak of the largest eager step
               (workers of one process step one at a time and reuse each other's
               activation memory: the largest of theirs, not the sum)

``held`` and ``reserve`` count this process's allocations only (``memory_allocated``):
another process on the GPU changes ``free``, not what a worker thinks it owns. Workers
sized together take the same number of blocks, so each holds the same tokens (a draft and
its target serve the same sequences). On CPU each worker takes enough blocks for every
sequence at full length, up to 2 GiB.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from specray.scheduler.config import DEFAULT_GPU_MEMORY_UTILIZATION

CPU_BUDGET = 2 * 1024**3


@dataclass(frozen=True)
class MemoryNeed:
    """One worker's side of the sizing (bytes)."""

    device: torch.device
    per_block: int          # one KV block, every layer, K and V
    useful: int             # blocks for max_num_seqs sequences at full length
    held: int = 0
    activations: int = 0    # the peak of its largest eager step
    graph_pool: int = 0     # held for good by its CUDA graphs

    @property
    def reserve(self) -> int:
        return self.activations + self.graph_pool


def block_bytes(layers: int, kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype) -> int:
    return 2 * layers * block_size * kv_heads * head_dim * torch.tensor([], dtype=dtype).element_size()


def kv_budget(share: float, total: int, free: int, held: int, reserve: int) -> int:
    """Bytes the KV caches may take (see the module docstring); never negative."""
    return max(0, min(int(share * total) - held - reserve, free - reserve))


def plan_blocks(needs: list[MemoryNeed], share: float | None, mem_get_info: Callable | None = None) -> list[int]:
    """Blocks for each worker of ``needs`` (one process's, sized together). CUDA: the same
    count for all, from one budget; refuses (ValueError) when the share cannot hold even
    one block each. ``mem_get_info``: ``torch.cuda.mem_get_info`` unless given."""
    if not needs:
        return []
    dev = needs[0].device
    if dev.type != "cuda":
        return [max(1, min(n.useful, CPU_BUDGET // n.per_block)) for n in needs]
    share = DEFAULT_GPU_MEMORY_UTILIZATION if share is None else share
    free, total = (mem_get_info or torch.cuda.mem_get_info)(dev)
    held = sum(n.held for n in needs)
    reserve = sum(n.graph_pool for n in needs) + max(n.activations for n in needs)
    budget = kv_budget(share, total, free, held, reserve)
    blocks = min(min(n.useful for n in needs), budget // sum(n.per_block for n in needs))
    if blocks < 1:
        gib = 1024**3
        raise ValueError(f"gpu_memory_utilization={share:g} of {total / gib:.1f} GiB leaves no room for a KV block: "
                         f"the models hold {held / gib:.2f} GiB, their steps need {reserve / gib:.2f} GiB, "
                         f"{free / gib:.2f} GiB is free")
    return [blocks] * len(needs)


def peak_bytes(device: torch.device, fn: Callable[[], object]) -> int:
    """Memory ``fn`` allocates at its peak beyond what is allocated now (0 off CUDA)."""
    if device.type != "cuda":
        fn()
        return 0
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    torch.cuda.synchronize(device)
    return max(0, torch.cuda.max_memory_allocated(device) - base)


def allocated(device: torch.device) -> int:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


def release(device: torch.device) -> None:
    """Give cached blocks back to the driver, so ``mem_get_info`` sees them free."""
    if device.type == "cuda":
        import gc

        gc.collect()
        torch.cuda.empty_cache()
