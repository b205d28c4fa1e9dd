"""A worker's paged KV cache: per-layer slot tensors plus the worker's own BlockManager.

With prefix caching the pool's keys are the names the driver's mirror gives its cached
blocks (``specray.scheduler.block_manager``): a plan's cache events keep the two pools
holding the same cached contents, and a sequence new here may start with cached blocks
(``StepPlan.num_hits``), whose K/V another sequence wrote, and feed only the rest."""

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
        self.blocks = BlockManager(num_blocks, block_size, enable_prefix_caching=True, named_by_driver=True)
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
        """The plan's cache events and frees first (``StepPlan``'s order), then each
        sequence's pool is resized to the slots the driver reserved (truncation drops
        rejected lookahead, growth makes room for this step), a newcomer starting with its
        hit blocks. ``lookahead[i]``: slots the step writes past the fed tokens (draft
        passes, proposals). The whole plan is checked first: a refused plan changes
        nothing."""
        self._check(plan, lookahead)
        bm = self.blocks
        if plan.uncached_all:
            bm.uncache_all()
        for sid, j, name in zip(plan.cached_seq_ids, plan.cached_index, plan.cached_names):
            bm.cache_block(sid, j, name)
        for sid in plan.free_seq_ids:
            bm.free(sid)
            self.num_written.pop(sid, None)
        for name in plan.evicted_names:
            bm.evict(name)
        # Every shrink before any growth: the check counted the pool as a whole, so the
        # order of sequences in the plan cannot make an allocation fail half-way.
        pairs = list(zip(plan.seq_ids, plan.num_slots))
        for sid, slots in pairs:
            if bm.blocks_needed(slots) < len(bm.block_table(sid)):
                bm.allocate_slots(sid, slots)
        hits = _hits_by_seq(plan)
        for i, (sid, slots) in enumerate(pairs):
            if not bm.allocate_slots(sid, slots, hits=hits[i]):
                raise AssertionError(f"sequence {sid}: allocation failed after the pool check")
        for i, sid in enumerate(plan.seq_ids):
            self.num_written[sid] = plan.num_computed[i] + plan.num_new[i] + (lookahead[i] if lookahead else 0)

    def _check(self, plan: StepPlan, lookahead: list[int] | None) -> None:
        bm = self.blocks
        freed = set(plan.free_seq_ids)
        for sid, j in zip(plan.cached_seq_ids, plan.cached_index):
            if j >= len(bm.block_table(sid)):
                # A worker that restarted holds nothing the driver counts on.
                raise StaleCacheError(f"the driver caches block {j} of sequence {sid}, this worker holds "
                                      f"{len(bm.block_table(sid))} blocks of it (restarted?)")
        # Names the plan keeps: those cached here now (unless it forgets them all) and
        # those it registers.
        known = not plan.uncached_all
        registered = set(plan.cached_names)
        evicted = set(plan.evicted_names)
        hits = _hits_by_seq(plan)
        growth = 0
        for i, (sid, computed, new, slots) in enumerate(zip(plan.seq_ids, plan.num_computed, plan.num_new,
                                                            plan.num_slots)):
            held = 0 if sid in freed else len(bm.block_table(sid))
            if hits[i]:
                if held:
                    raise PlanError(f"StepPlan.num_hits[{i}]: sequence {sid} already holds blocks here")
                if computed != len(hits[i]) * self.block_size:
                    raise PlanError(f"StepPlan.num_computed[{i}]: sequence {sid} starts with {len(hits[i])} "
                                    f"cached blocks, the plan counts {computed} cached tokens")
                for name in hits[i]:
                    cached = (known and bm.is_cached(name)) or name in registered
                    if name in evicted or not cached:
                        raise StaleCacheError(f"sequence {sid}: the driver counts block {name} as cached, "
                                              "this worker does not hold it (restarted?)")
            else:
                if computed > held * self.block_size:
                    if sid in freed:
                        raise PlanError(f"StepPlan.num_computed[{i}]: sequence {sid} is freed by this plan "
                                        f"and cannot have {computed} cached tokens")
                    raise StaleCacheError(f"sequence {sid}: the driver counts {computed} cached tokens, "
                                          f"this worker holds {held * self.block_size} slots (restarted?)")
                if computed > self.num_written.get(sid, 0):
                    raise PlanError(f"StepPlan.num_computed[{i}]: sequence {sid} has "
                                    f"{self.num_written.get(sid, 0)} tokens written, the plan counts {computed} "
                                    "cached")
            if new < 1:
                # Each sequence's next-token logits come from its last fed token.
                raise PlanError(f"StepPlan.num_new[{i}]: sequence {sid} feeds no token")
            need = computed + new + (lookahead[i] if lookahead else 0)
            if slots < need:
                # Positions past the block table would land in another sequence's blocks.
                raise PlanError(f"StepPlan.num_slots[{i}]: sequence {sid} reserves {slots} slots, "
                                f"its step writes {need}")
            growth += bm.blocks_needed(slots) - held - len(hits[i])
        empty = self._empty_after_frees(plan)
        if growth > empty:
            raise RuntimeError(f"KV pool out of blocks: the plan needs {growth} more blocks, {empty} are empty: "
                               "the driver's mirror disagrees with this worker")

    def _empty_after_frees(self, plan: StepPlan) -> int:
        """Empty blocks once the plan's cache events and frees are applied: new blocks come
        only from these (the driver names every eviction). Refuses evictions of names this
        worker does not hold free. Truncated tails need no count here: they are never
        cached nor shared (only committed blocks are, and those lie below every sequence's
        slot count), so growth's negative part frees them."""
        bm = self.blocks
        keyed_by_plan = {bm.block_table(s)[j]: n for s, j, n in
                         zip(plan.cached_seq_ids, plan.cached_index, plan.cached_names)}
        empty = bm.num_empty_blocks + (bm.num_free_blocks - bm.num_empty_blocks if plan.uncached_all else 0)
        freed = bm.blocks_freed_by(plan.free_seq_ids)
        freed_now = set(freed)
        named = {n: b for b, n in keyed_by_plan.items()}
        for b in freed:
            if b not in keyed_by_plan and (plan.uncached_all or bm.key_of(b) is None):
                empty += 1
        for name in plan.evicted_names:
            b = named.get(name, None if plan.uncached_all else bm.block_of(name))
            if b is None or not (b in freed_now or bm.is_evictable(b)):
                raise RuntimeError(f"the driver evicts {name}, which this worker does not hold free: "
                                   "the driver's mirror disagrees with this worker")
            empty += 1
        return empty

    def tables(self, seq_ids: list[int]) -> list[list[int]]:
        return [self.blocks.block_table(s) for s in seq_ids]


def _hits_by_seq(plan: StepPlan) -> list[list[int]]:
    """Each sequence's hit names (``StepPlan.num_hits``), empty lists where it has none."""
    if not plan.num_hits:
        return [[] for _ in plan.seq_ids]
    out, pos = [], 0
    for n in plan.num_hits:
        out.append(plan.hit_names[pos:pos + n])
        pos += n
    return out
