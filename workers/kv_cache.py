"""A worker's paged KV cache: per-layer slot tensors plus the worker's own BlockManager."""

from __future__ import annotations

import torch

from specray.scheduler.block_manager import BlockManager
from specray.scheduler.messages import StepPlan
from specray.workers.errors import PlanError, StaleCacheError
from specray.workers.tensor_parallel import local_kv_heads


def kv_shape(config, tp_size: int = 1, tp_rank: int = 0) -> tuple[int, int, int]:
    """(layers, KV heads, head_dim) of one worker's cache; rank ``tp_rank`` of a
    tensor-parallel group of ``tp_size`` holds its own KV heads only (``tensor_parallel``)."""
    heads = config.num_attention_heads
    kvh = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return config.num_hidden_layers, local_kv_heads(kvh, tp_size, tp_rank), head_dim


class KVCache:
    def __init__(self, config, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device,
                 tp_size: int = 1, tp_rank: int = 0):
        layers, kvh, head_dim = kv_shape(config, tp_size, tp_rank)
        self.block_size = block_size
        self.blocks = BlockManager(num_blocks, block_size)
        # Tokens whose K/V each sequence may hold (fed plus lookahead written by its last
        # step). Slot counts alone are rounded up to blocks and include reserved slots never
        # written, so they cannot tell a driver bug from a real cache hit.
        self.num_written: dict[int, int] = {}
        # One block past the pool's: a scratch block no sequence owns, where the padding
        # rows of a bucketed (CUDA graph) step write.
        self.scratch_block = num_blocks
        slots = (num_blocks + 1) * block_size
        self.layers = [(torch.zeros(slots, kvh, head_dim, dtype=dtype, device=device),
                        torch.zeros(slots, kvh, head_dim, dtype=dtype, device=device)) for _ in range(layers)]

    def apply(self, plan: StepPlan, lookahead: list[int] | None = None) -> None:
        """Frees first, then each sequence's pool is resized to the slots the driver
        reserved (truncation drops rejected lookahead, growth makes room for this step).
        ``lookahead[i]``: slots the step writes past the fed tokens (draft passes,
        proposals). The whole plan is checked first: a refused plan changes nothing."""
        self._check(plan, lookahead)
        bm = self.blocks
        for sid in plan.free_seq_ids:
            bm.free(sid)
            self.num_written.pop(sid, None)
        # Every shrink before any growth: the check counted the pool as a whole, so the
        # order of sequences in the plan cannot make an allocation fail half-way.
        pairs = list(zip(plan.seq_ids, plan.num_slots))
        for sid, slots in pairs:
            if bm.blocks_needed(slots) < len(bm.block_table(sid)):
                bm.allocate_slots(sid, slots)
        for sid, slots in pairs:
            if not bm.allocate_slots(sid, slots):
                raise AssertionError(f"sequence {sid}: allocation failed after the pool check")
        for i, sid in enumerate(plan.seq_ids):
            self.num_written[sid] = plan.num_computed[i] + plan.num_new[i] + (lookahead[i] if lookahead else 0)

    def _check(self, plan: StepPlan, lookahead: list[int] | None) -> None:
        bm = self.blocks
        freed = set(plan.free_seq_ids)
        released = sum(len(bm.block_table(s)) for s in freed)
        growth = 0
        for i, (sid, computed, new, slots) in enumerate(zip(plan.seq_ids, plan.num_computed, plan.num_new,
                                                            plan.num_slots)):
            held = 0 if sid in freed else len(bm.block_table(sid))
            if computed > held * self.block_size:
                if sid in freed:
                    raise PlanError(f"StepPlan.num_computed[{i}]: sequence {sid} is freed by this plan "
                                    f"and cannot have {computed} cached tokens")
                raise StaleCacheError(f"sequence {sid}: the driver counts {computed} cached tokens, "
                                      f"this worker holds {held * self.block_size} slots (restarted?)")
            if computed > self.num_written.get(sid, 0):
                raise PlanError(f"StepPlan.num_computed[{i}]: sequence {sid} has {self.num_written.get(sid, 0)} "
                                f"tokens written, the plan counts {computed} cached")
            if new < 1:
                # Each sequence's next-token logits come from its last fed token.
                raise PlanError(f"StepPlan.num_new[{i}]: sequence {sid} feeds no token")
            need = computed + new + (lookahead[i] if lookahead else 0)
            if slots < need:
                # Positions past the block table would land in another sequence's blocks.
                raise PlanError(f"StepPlan.num_slots[{i}]: sequence {sid} reserves {slots} slots, "
                                f"its step writes {need}")
            growth += bm.blocks_needed(slots) - held
        if growth > bm.num_free_blocks + released:
            raise RuntimeError(f"KV pool out of blocks: the plan needs {growth} more blocks, "
                               f"{bm.num_free_blocks + released} are free: the driver's mirror disagrees "
                               "with this worker")

    def tables(self, seq_ids: list[int]) -> list[list[int]]:
        return [self.blocks.block_table(s) for s in seq_ids]
