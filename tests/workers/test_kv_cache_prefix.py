"""A worker's KV pool under the driver's cache events: hits start a newcomer with blocks
another sequence wrote, the worker evicts only what it is told, and a plan that names
what this worker does not hold is refused before it changes anything."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from specray_testing import make_plan

from specray.workers.errors import PlanError, StaleCacheError
from specray.workers.kv_cache import KVCache

BS = 4


def kv(num_blocks: int = 6) -> KVCache:
    cfg = SimpleNamespace(num_attention_heads=2, num_key_value_heads=1, hidden_size=8, num_hidden_layers=1)
    return KVCache(cfg, num_blocks, BS, torch.float32, torch.device("cpu"))


def state(c: KVCache):
    bm = c.blocks
    return ({s: list(t) for s, t in bm._tables.items()}, list(bm._free), list(bm._evictable), dict(bm._cached),
            dict(c.num_written))


def test_hits_share_blocks_and_evictions_are_the_drivers():
    c = kv()
    c.apply(make_plan([1], [0], [9], list(range(9)), [9]))            # 3 blocks
    first = c.blocks.block_table(1)
    # the driver names sequence 1's two full blocks 40 and 41, and sequence 2 starts with them
    plan = make_plan([1, 2], [9, 8], [1, 2], [9, 5, 6], [10, 10])
    plan.cached_seq_ids, plan.cached_index, plan.cached_names = [1, 1], [0, 1], [40, 41]
    plan.num_hits, plan.hit_names = [0, 2], [40, 41]
    c.apply(plan)
    assert c.blocks.block_table(2)[:2] == first[:2] and c.blocks._ref[first[0]] == 2
    c.blocks.check_integrity()
    # both end: the named blocks stay cached, evictable; the others are empty
    c.apply(make_plan([], [], [], [], [], free_seq_ids=[1, 2]))
    assert c.blocks.num_cached_blocks == 2 and len(c.blocks._free) == 4
    # a newcomer needing all six blocks fits only once the driver evicts both names
    big = make_plan([3], [0], [24], [1] * 24, [24])
    with pytest.raises(RuntimeError, match="out of blocks"):
        c.apply(big)
    big.evicted_names = [41, 40]
    c.apply(big)
    assert c.blocks.num_cached_blocks == 0 and len(c.blocks.block_table(3)) == 6
    c.blocks.check_integrity()


@pytest.mark.parametrize("bad, error", [
    (dict(num_hits=[2], hit_names=[40, 99]), StaleCacheError),         # a name it does not hold (restarted?)
    (dict(num_hits=[2], hit_names=[40, 41], evicted_names=[41]), StaleCacheError),
    (dict(num_hits=[1], hit_names=[40]), PlanError),                   # 8 computed, one block of hits
    (dict(cached_seq_ids=[7], cached_index=[0], cached_names=[50]), StaleCacheError),
    (dict(num_hits=[2], hit_names=[40, 41], evicted_names=[77]), RuntimeError),
])
def test_a_plan_naming_what_this_worker_does_not_hold_changes_nothing(bad, error):
    c = kv()
    plan = make_plan([1], [0], [9], list(range(9)), [9])
    plan.cached_seq_ids, plan.cached_index, plan.cached_names = [], [], []
    c.apply(plan)
    named = make_plan([], [], [], [], [], free_seq_ids=[1])
    named.cached_seq_ids, named.cached_index, named.cached_names = [1, 1], [0, 1], [40, 41]
    c.apply(named)
    before = state(c)
    plan = make_plan([2], [8], [2], [5, 6], [10])
    for k, v in bad.items():
        setattr(plan, k, v)
    with pytest.raises(error):
        c.apply(plan)
    assert state(c) == before
