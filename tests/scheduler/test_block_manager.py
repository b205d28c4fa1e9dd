"""BlockManager: exact block counts, all-or-nothing allocation, and a randomized run
checked against an independent model (seq -> slot count) after every operation."""

from __future__ import annotations

import random

import pytest

from specray.scheduler.block_manager import BlockManager


def ceil_div(a: int, b: int) -> int:
    return (a + b - 1) // b


def snapshot(bm: BlockManager):
    return list(bm._free), {s: list(t) for s, t in bm._tables.items()}


# -- exact counts -------------------------------------------------------------------

def test_constructor_rejects_empty_pool_and_block_size():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockManager(0, 4)
    with pytest.raises(ValueError, match="block_size"):
        BlockManager(4, 0)


def test_allocate_slots_counts_blocks_exactly():
    bm = BlockManager(10, 4)
    assert bm.blocks_needed(0) == 0
    assert [bm.blocks_needed(n) for n in (1, 4, 5, 8, 9, 11, 12, 13)] == [1, 1, 2, 2, 3, 3, 3, 4]
    assert bm.allocate_slots(1, 9 + 2)   # 9 tokens and 2 lookahead slots -> 3 blocks
    assert len(bm.block_table(1)) == 3
    assert bm.num_free_blocks == 7 and bm.num_used_blocks == 3
    # low ids first, as the docstring promises
    assert bm.block_table(1) == [0, 1, 2]
    # growing by one slot that still fits the last block allocates nothing
    assert bm.allocate_slots(1, 12)
    assert bm.num_free_blocks == 7
    # 13 slots -> one more block
    assert bm.allocate_slots(1, 13)
    assert len(bm.block_table(1)) == 4 and bm.num_free_blocks == 6
    assert bm.allocate_slots(2, 0)       # zero slots: a table with no blocks
    assert bm.block_table(2) == [] and bm.has(2) and bm.num_free_blocks == 6
    bm.check_integrity()


def test_allocate_slots_shrinks_to_exactly_what_the_slots_need():
    bm = BlockManager(10, 4)
    assert bm.allocate_slots(1, 11)      # 3 blocks: [0,1,2]
    assert bm.allocate_slots(1, 10)      # ceil(10/4) = 3: nothing to free
    assert bm.block_table(1) == [0, 1, 2]
    assert bm.allocate_slots(1, 8)       # keep 2: the rejected lookahead's block goes back
    assert bm.block_table(1) == [0, 1]
    assert bm.num_free_blocks == 8
    assert bm.allocate_slots(1, 0)
    assert bm.block_table(1) == [] and bm.has(1)
    assert bm.num_free_blocks == 10
    bm.check_integrity()


def test_allocate_slots_rejects_a_negative_count():
    bm = BlockManager(4, 4)
    with pytest.raises(ValueError, match="negative"):
        bm.allocate_slots(1, -1)


def test_can_allocate_slots_matches_allocate_slots():
    bm = BlockManager(5, 4)
    assert bm.allocate_slots(1, 8)            # 2 blocks, 3 free
    assert bm.can_allocate_slots(2, 12)       # 3 blocks
    assert not bm.can_allocate_slots(2, 13)   # 4 blocks
    assert bm.can_allocate_slots(1, 20)       # has 2, needs 5: 3 more
    assert not bm.can_allocate_slots(1, 21)
    assert bm.can_allocate_slots(1, 4)        # shrinking always fits
    for seq, n in [(2, 12), (2, 13), (1, 20), (1, 21), (3, 0), (1, 1)]:
        fresh = BlockManager(5, 4)
        fresh.allocate_slots(1, 8)
        assert fresh.can_allocate_slots(seq, n) == fresh.allocate_slots(seq, n)


def test_failed_allocate_slots_changes_nothing():
    bm = BlockManager(4, 4)
    assert bm.allocate_slots(1, 6)       # 2 blocks
    assert bm.allocate_slots(2, 3)       # 1 block, 1 free
    before = snapshot(bm)
    assert bm.allocate_slots(3, 5) is False    # needs 2, 1 free: new seq
    assert snapshot(bm) == before
    assert not bm.has(3)
    assert bm.allocate_slots(1, 13) is False   # existing seq: needs 2 more
    assert snapshot(bm) == before
    assert bm.has(1)
    assert bm.allocate_slots(2, 8)       # 1 more block, exactly the free one
    assert bm.num_free_blocks == 0
    before = snapshot(bm)
    assert not bm.allocate_slots(4, 1)   # an empty pool refuses even one slot
    assert snapshot(bm) == before
    bm.check_integrity()


def test_shrinking_returns_blocks_for_reuse():
    bm = BlockManager(4, 4)
    assert bm.allocate_slots(1, 16)
    assert not bm.allocate_slots(2, 1)
    assert bm.allocate_slots(1, 5)       # 2 blocks back
    assert bm.allocate_slots(2, 8)
    assert not set(bm.block_table(1)) & set(bm.block_table(2))
    bm.check_integrity()


def test_free_returns_everything_and_reset_forgets_all():
    bm = BlockManager(8, 2)
    assert bm.allocate_slots(1, 5)       # 3
    assert bm.allocate_slots(2, 3)       # 2
    assert bm.free(1) == 3
    assert not bm.has(1) and bm.block_table(1) == []
    assert bm.num_free_blocks == 6
    assert bm.free(1) == 0               # twice is harmless
    assert bm.free(42) == 0
    bm.check_integrity()
    bm.reset()
    assert bm.num_free_blocks == 8 and not bm.has(2)
    assert bm.num_blocks == 8 and bm.block_size == 2
    assert bm.allocate_slots(3, 16)      # the whole pool is usable again
    assert bm.num_free_blocks == 0
    bm.check_integrity()


# -- integrity ----------------------------------------------------------------------

def test_check_integrity_detects_a_block_free_twice():
    bm = BlockManager(4, 4)
    bm.allocate_slots(1, 4)
    bm._free.append(bm._free[-1])        # one free block listed twice
    with pytest.raises(AssertionError):
        bm.check_integrity()


def test_check_integrity_detects_a_block_both_owned_and_free():
    bm = BlockManager(4, 4)
    bm.allocate_slots(1, 8)
    bm._free[0] = bm.block_table(1)[0]   # counts add up, ids do not
    with pytest.raises(AssertionError, match="owned and free"):
        bm.check_integrity()


def test_check_integrity_detects_a_lost_block_and_out_of_range_id():
    bm = BlockManager(4, 4)
    bm.allocate_slots(1, 4)
    bm._free.pop()
    with pytest.raises(AssertionError, match="total"):
        bm.check_integrity()
    bm = BlockManager(4, 4)
    bm._free[0] = 17
    with pytest.raises(AssertionError, match="range"):
        bm.check_integrity()
    bm = BlockManager(4, 4)
    bm.allocate_slots(1, 4)
    bm.allocate_slots(2, 4)
    bm._tables[2][0] = bm._tables[1][0]  # two sequences share a block its count says one holds (one is lost)
    with pytest.raises(AssertionError, match="total|ref"):
        bm.check_integrity()


def test_failed_allocate_keeps_an_existing_empty_table():
    bm = BlockManager(2, 4)
    assert bm.allocate_slots(1, 8)       # pool full
    assert bm.allocate_slots(2, 0)       # seq 2 known, no blocks
    assert bm.has(2)
    before = snapshot(bm)
    assert not bm.allocate_slots(2, 1)
    assert snapshot(bm) == before        # seq 2's empty table survives the failure
    assert bm.has(2)


# -- randomized against an independent model -----------------------------------------

@pytest.mark.parametrize("seed,num_blocks,block_size", [(0, 16, 4), (1, 7, 1), (2, 30, 3), (3, 5, 16)])
def test_random_operations_match_model(seed, num_blocks, block_size):
    rng = random.Random(seed)
    bm = BlockManager(num_blocks, block_size)
    model: dict[int, int] = {}   # seq -> blocks owned (derived from slot counts only)
    seqs = list(range(6))
    max_slots = num_blocks * block_size + 2 * block_size
    counts = {"alloc_ok": 0, "alloc_fail": 0, "free": 0, "reset": 0}
    for _ in range(3000):
        op = rng.random()
        sid = rng.choice(seqs)
        have = model.get(sid, 0)
        free = num_blocks - sum(model.values())
        if op < 0.8:
            n = rng.randrange(0, max_slots)
            need = ceil_div(n, block_size)
            expect_ok = need - have <= free
            assert bm.can_allocate_slots(sid, n) == expect_ok
            before = snapshot(bm)
            ok = bm.allocate_slots(sid, n)
            assert ok == expect_ok
            if ok:
                counts["alloc_ok"] += 1
                model[sid] = need
            else:
                counts["alloc_fail"] += 1
                assert snapshot(bm) == before      # all or nothing: a failure changes nothing
        elif op < 0.995:
            freed = bm.free(sid)
            assert freed == model.pop(sid, 0)
            counts["free"] += 1
        else:
            bm.reset()
            model.clear()
            counts["reset"] += 1
        bm.check_integrity()
        assert bm.num_free_blocks == num_blocks - sum(model.values())
        assert bm.num_used_blocks == sum(model.values())
        for s in seqs:
            assert bm.has(s) == (s in model)
            assert len(bm.block_table(s)) == model.get(s, 0)
    # the run exercised every branch
    assert all(v > 0 for k, v in counts.items() if k != "reset")
    assert counts["alloc_fail"] > 50 and counts["alloc_ok"] > 300
