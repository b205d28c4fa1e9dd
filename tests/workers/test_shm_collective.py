"""The shared-memory collectives of a CPU tensor-parallel group.

References: sums and concatenations computed here from the ranks' inputs (the same bits on
every rank), over enough collectives of changing shapes to reuse both buffers; a peer that
cannot map the segment (another host) sends every rank to gloo; a peer process that dies
is reported at once, not at the timeout; nothing is left in the shared-memory folder."""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from specray.workers import shm_collective
from specray.workers.tensor_parallel import RankGroup

pytestmark = pytest.mark.skipif(not shm_collective.supported(), reason="shared-memory collectives: x86-64 Linux")
CPU = torch.device("cpu")


def on_ranks(size: int, fn):
    with ThreadPoolExecutor(size) as pool:
        return [f.result(timeout=60) for f in [pool.submit(fn, r) for r in range(size)]]


def leftovers() -> set[str]:
    return {f for f in os.listdir(shm_collective._directory()) if f.startswith("specray-tp-")}


def inputs(rank: int, i: int) -> torch.Tensor:
    shape = [(1, 5), (7, 33), (40, 576), (3,)][i % 4]
    return torch.randn(shape, generator=torch.Generator().manual_seed(1000 * i + rank))


@pytest.mark.parametrize("size", [2, 3])
def test_sums_and_gathers_equal_the_reference_on_every_rank(size):
    before = leftovers()
    store = dist.HashStore()
    groups = on_ranks(size, lambda r: RankGroup(store, r, size, CPU, 10.0))
    assert [g.transport for g in groups] == ["shm"] * size
    assert leftovers() == before

    def run(r):
        got = []
        for i in range(41):                  # odd: both buffers, each written many times
            x = inputs(r, i)
            got.append(groups[r].all_gather(x) if i % 5 == 4 else groups[r].all_reduce(x.clone()))
        return got

    results = on_ranks(size, run)
    for i in range(41):
        xs = [inputs(r, i) for r in range(size)]
        if i % 5 == 4:
            want = torch.cat(xs, dim=-1)
        else:
            want = xs[0] + xs[1]
            for x in xs[2:]:
                want = want + x
        for r in range(size):
            assert torch.equal(results[r][i], results[0][i])     # the same bits on every rank
        torch.testing.assert_close(results[0][i], want, rtol=1e-6, atol=1e-6)
    for g in groups:
        g.close()


def test_a_tensor_larger_than_a_slot_goes_through_gloo():
    store = dist.HashStore()
    groups = on_ranks(2, lambda r: RankGroup(store, r, 2, CPU, 10.0))
    big = shm_collective.DEFAULT_CAPACITY // 4 + 1
    assert not groups[0].shm.fits(torch.empty(big)) and groups[0].shm.fits(torch.empty(big - 1))
    out = on_ranks(2, lambda r: groups[r].all_reduce(torch.full((big,), float(r + 1))))
    assert all(torch.equal(o, torch.full((big,), 3.0)) for o in out)
    for g in groups:
        g.close()


def test_a_shared_memory_folder_without_room_sends_the_group_to_gloo(monkeypatch):
    before = leftovers()

    def full(fd, offset, length):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    store = dist.HashStore()
    groups = on_ranks(2, lambda r: RankGroup(store, r, 2, CPU, 5.0))
    assert [g.transport for g in groups] == ["gloo", "gloo"]
    assert leftovers() == before
    assert on_ranks(2, lambda r: float(groups[r].all_reduce(torch.ones(2))[0])) == [2.0, 2.0]


def test_a_peer_that_never_joins_leaves_nothing_behind():
    """Rank 0 alone: its wait for rank 1's vote ends at the store's timeout, raising, and
    the segment it made is gone."""
    before = leftovers()
    store = dist.HashStore()
    store.set_timeout(timedelta(seconds=1))
    with pytest.raises(Exception, match="(?i)timeout|wait"):
        shm_collective.connect(store, 0, 2, 5.0)
    assert leftovers() == before


class _Elsewhere:
    """Rank 1's view of a store whose rank 0 lives on another host: the segment it names
    is not there."""

    def __init__(self, store):
        self.store = store

    def set(self, key, value):
        self.store.set(key, value)

    def get(self, key):
        value = self.store.get(key)
        return value + b"-on-another-host" if key.endswith("name") else value


def test_a_rank_that_cannot_map_the_segment_sends_every_rank_to_gloo():
    before = leftovers()
    store = dist.HashStore()
    store.set_timeout(timedelta(seconds=20))
    views = [store, _Elsewhere(store)]
    made = on_ranks(2, lambda r: shm_collective.connect(views[r], r, 2, 5.0))
    assert made == [None, None]
    assert leftovers() == before
    groups = on_ranks(2, lambda r: RankGroup(store, r, 2, CPU, 5.0, shared_memory=False))
    assert [g.transport for g in groups] == ["gloo", "gloo"]
    assert on_ranks(2, lambda r: float(groups[r].all_reduce(torch.ones(2))[0])) == [2.0, 2.0]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _peer(port: int) -> None:
    """Rank 1 in a process of its own: one collective, then it dies."""
    store = dist.TCPStore("127.0.0.1", port, world_size=2, is_master=False, timeout=timedelta(seconds=30))
    group = RankGroup(store, 1, 2, CPU, 30.0)
    group.all_reduce(torch.full((4,), 2.0))
    os._exit(9)


def test_a_peer_process_that_dies_is_reported_at_once():
    port = _free_port()
    store = dist.TCPStore("127.0.0.1", port, world_size=2, is_master=True, timeout=timedelta(seconds=30),
                          wait_for_workers=False)
    child = mp.get_context("spawn").Process(target=_peer, args=(port,))
    child.start()
    group = RankGroup(store, 0, 2, CPU, 30.0)
    assert group.transport == "shm"
    assert torch.equal(group.all_reduce(torch.ones(4)), torch.full((4,), 3.0))
    child.join(30)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="rank 1 died"):
        group.all_reduce(torch.ones(4))
    assert time.monotonic() - t0 < 5          # the group's timeout is 30 s
    assert group.broken
    group.close()
