"""Host integer lists to the device, the way every step sends its metadata.

On CUDA the host tensor is page-locked before the copy: ``non_blocking=True`` from
pageable memory is staged through a driver buffer and waits for it, so the host would
stall on every metadata copy. Pinned tensors come from torch's caching host allocator,
which hands a block out again only after the copy that read it has completed, so a
buffer is never overwritten while its copy is in flight.
"""

from __future__ import annotations

import torch


def host_tensor(values, device: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """``values`` as a CPU tensor, pinned when it is bound for a CUDA device."""
    t = torch.tensor(values, dtype=dtype)
    return t.pin_memory() if device.type == "cuda" else t


def to_device(values, device: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    return host_tensor(values, device, dtype).to(device, non_blocking=True)
