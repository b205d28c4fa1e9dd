"""A fixed pool of KV-cache blocks and the block table of each sequence.

Each worker owns one BlockManager for its own cache; the driver keeps a mirror of it
(the same class, fed the same operations) to decide admission and preemption without
asking the worker. Block counts are a pure function of each sequence's slot count, so
the mirror and the worker agree on how many blocks are free even though they may hand
out different physical ids.

Slots of one sequence, block_size = 4, 9 tokens in KV plus 2 lookahead slots (the KV
slots a step reserves past a sequence's tokens for its proposals)::

    block table:  [ 7 ][ 2 ][ 5 ]
    slots:        0..3  4..7  8  9 10 11
                  KV    KV    KV la la  (free)

``allocate_slots(seq, 9, num_lookahead=2)`` makes the sequence hold exactly the 3 blocks
11 slots need. After the target accepts one of the two lookahead tokens,
``allocate_slots(seq, 10)`` keeps ``blocks_needed(10, 4)`` = 3 blocks; stale slots past 10
are simply overwritten by the next step.
"""

from __future__ import annotations


def blocks_needed(num_slots: int, block_size: int) -> int:
    """Blocks that hold ``num_slots`` slots: the one place the rounding up is written."""
    return -(-num_slots // block_size)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size <= 0:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # Popping from the end hands out low ids first, which keeps small tests readable.
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._tables: dict[int, list[int]] = {}

    # -- queries -------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_needed(self, num_slots: int) -> int:
        return blocks_needed(num_slots, self.block_size)

    def block_table(self, seq_id: int) -> list[int]:
        return self._tables.get(seq_id, [])

    def has(self, seq_id: int) -> bool:
        return seq_id in self._tables

    def can_allocate_slots(self, seq_id: int, num_tokens: int, num_lookahead: int = 0) -> bool:
        """Whether ``allocate_slots`` with these arguments would succeed (shrinking always does)."""
        want = self.blocks_needed(num_tokens + num_lookahead)
        return want - len(self._tables.get(seq_id, ())) <= len(self._free)

    # -- operations ----------------------------------------------------------------
    def allocate_slots(self, seq_id: int, num_tokens: int, num_lookahead: int = 0) -> bool:
        """Make the sequence hold exactly the blocks its ``num_tokens`` tokens and
        ``num_lookahead`` lookahead slots need (vLLM's signature): blocks past them go back
        to the pool, missing ones are taken from it. All or nothing: returns False (and
        changes nothing) when the pool cannot hold them; the caller preempts or waits."""
        if num_tokens < 0 or num_lookahead < 0:
            raise ValueError(f"negative slot count: {num_tokens} tokens, {num_lookahead} lookahead")
        table = self._tables.get(seq_id)
        want = self.blocks_needed(num_tokens + num_lookahead)
        have = len(table) if table is not None else 0
        if want - have > len(self._free):
            return False
        if table is None:
            table = self._tables[seq_id] = []
        if want < have:
            self._free.extend(reversed(table[want:]))
            del table[want:]
        for _ in range(want - have):
            table.append(self._free.pop())
        return True

    def free(self, seq_id: int) -> int:
        table = self._tables.pop(seq_id, None)
        if table is None:
            return 0
        self._free.extend(reversed(table))
        return len(table)

    def reset(self) -> None:
        """Forget every sequence (the worker behind this pool restarted empty)."""
        self.__init__(self.num_blocks, self.block_size)

    def check_integrity(self) -> None:
        owned = [b for table in self._tables.values() for b in table]
        all_ids = owned + self._free
        if len(all_ids) != self.num_blocks:
            raise AssertionError(
                f"free ({len(self._free)}) + used ({len(owned)}) != total ({self.num_blocks})")
        if len(set(all_ids)) != self.num_blocks:
            raise AssertionError("a block is owned twice or both owned and free")
        if any(not 0 <= b < self.num_blocks for b in all_ids):
            raise AssertionError("block id out of range")
