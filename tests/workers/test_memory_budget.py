"""KV sizing against a stubbed ``torch.cuda.mem_get_info``: a worker's share, what it holds
and needs, two workers on one GPU, and the workers of one process sized together."""

from __future__ import annotations

import pytest
import torch

from specray.runtime.config import RuntimeConfig
from specray.runtime.transport import worker_pool
from specray.scheduler.config import CacheConfig
from specray.workers import memory_budget
from specray.workers.memory_budget import MemoryNeed, kv_budget, plan_blocks

GIB = 1024**3
CUDA = torch.device("cuda")


def stub(free: int, total: int = 100 * GIB):
    return lambda device: (free, total)


def test_budget_is_the_share_less_what_is_held_and_needed():
    assert kv_budget(0.9, 100 * GIB, 80 * GIB, 20 * GIB, 5 * GIB) == 65 * GIB
    # Another process holds more than its share: what is free caps it.
    assert kv_budget(0.9, 100 * GIB, 30 * GIB, 20 * GIB, 5 * GIB) == 25 * GIB
    assert kv_budget(0.2, 100 * GIB, 80 * GIB, 20 * GIB, 5 * GIB) == 0


def test_blocks_from_the_budget_and_capped_by_what_sequences_can_use():
    need = MemoryNeed(CUDA, per_block=GIB // 16, useful=10**6, held=20 * GIB, activations=3 * GIB, graph_pool=GIB)
    assert plan_blocks([need], 0.9, stub(free=80 * GIB)) == [(90 - 24) * 16]
    few = MemoryNeed(CUDA, per_block=GIB // 16, useful=100, held=20 * GIB, activations=3 * GIB, graph_pool=GIB)
    assert plan_blocks([few], 0.9, stub(free=80 * GIB)) == [100]
    assert plan_blocks([need], None, stub(free=80 * GIB)) == [(90 - 24) * 16]    # the default share


def test_one_process_reserves_every_graph_pool_and_its_largest_step():
    """Sized together, a target and its draft keep both graph pools but step one at a time:
    the larger of their activation peaks, not the sum, and the same blocks each."""
    target = MemoryNeed(CUDA, per_block=GIB // 8, useful=10**6, held=20 * GIB, activations=4 * GIB, graph_pool=GIB)
    draft = MemoryNeed(CUDA, per_block=GIB // 8, useful=10**6, held=2 * GIB, activations=GIB, graph_pool=GIB)
    blocks = plan_blocks([target, draft], 0.9, stub(free=78 * GIB))
    assert blocks == [(90 - 22 - 2 - 4) * 8 // 2] * 2


def test_a_share_that_cannot_hold_one_block_is_refused():
    need = MemoryNeed(CUDA, per_block=GIB, useful=100, held=40 * GIB, activations=5 * GIB)
    with pytest.raises(ValueError, match="gpu_memory_utilization=0.45 .* leaves no room for a KV block"):
        plan_blocks([need], 0.45, stub(free=60 * GIB))


def test_two_workers_sizing_at_once_fit_the_gpu_together():
    """Both read mem_get_info before either allocates. Half of the free memory each (the
    old rule) would book the whole GPU twice over their weights; each worker's own share
    keeps the sum within the utilization."""
    total = 100 * GIB
    target = MemoryNeed(CUDA, per_block=GIB // 8, useful=10**6, held=30 * GIB, activations=2 * GIB, graph_pool=GIB)
    draft = MemoryNeed(CUDA, per_block=GIB // 64, useful=10**6, held=2 * GIB, activations=GIB)
    free = total - target.held - draft.held          # both loaded, neither has a cache yet
    shares = {"target": worker_pool.worker_cache(CacheConfig(), 0.5).gpu_memory_utilization,
              "draft": worker_pool.worker_cache(CacheConfig(), 0.5).gpu_memory_utilization}
    assert shares == {"target": 0.45, "draft": 0.45}
    kv = {name: plan_blocks([n], shares[name], stub(free, total))[0] * n.per_block
          for name, n in (("target", target), ("draft", draft))}
    used = sum(n.held + n.reserve for n in (target, draft)) + sum(kv.values())
    assert used <= 0.9 * total


def test_worker_share_follows_the_part_of_a_gpu_it_asks_for():
    assert worker_pool.worker_cache(CacheConfig(), 1).gpu_memory_utilization == 0.9
    assert worker_pool.worker_cache(CacheConfig(), 0.25).gpu_memory_utilization == 0.225
    assert worker_pool.worker_cache(CacheConfig(), 0).gpu_memory_utilization is None      # no GPU
    given = CacheConfig(gpu_memory_utilization=0.3)
    assert worker_pool.worker_cache(given, 0.5) is given
    with pytest.raises(ValueError, match=r"gpu_memory_utilization must be a number in \(0, 1\]"):
        CacheConfig(gpu_memory_utilization=1.5)
    assert RuntimeConfig(target="t", proposer="none", gpu_memory_utilization=0.5).cache.gpu_memory_utilization == 0.5


def test_workers_of_one_process_are_sized_together(llama_pair, monkeypatch):
    """Co-located: every model is loaded before any cache is sized, from one share, and
    each worker gets the same number of blocks (a draft serves its target's sequences)."""
    seen = []

    def plan(needs, share, mem_get_info=None):
        seen.append((list(needs), share))
        return [7] * len(needs)

    monkeypatch.setattr(memory_budget, "plan_blocks", plan)
    t, d = llama_pair
    cfg = RuntimeConfig(target=t, draft=d, device="cpu", dtype="float32", block_size=4, layout="colocated",
                        target_resources={"GPU": 0.5})
    from specray.runtime.settled import settle

    pool = worker_pool.start_workers(settle(cfg))
    try:
        (needs, share), = seen
        assert share == pytest.approx(0.45)
        assert [n.per_block for n in needs] == [w.runner.need.per_block for w in pool.local_workers]
        assert pool.target_blocks == [7] and pool.draft_blocks == [7]
        assert [w.runner.num_blocks for w in pool.local_workers] == [7, 7]
    finally:
        pool.release()
