"""A fixed pool of KV-cache blocks, the block table of each sequence, and the cache of
full blocks whose content is known (prefix caching).

Each worker owns one BlockManager for its own cache; the driver keeps a mirror of it
(the same class, fed the same operations) to decide admission, preemption and cache hits
without asking the worker. Block counts are a pure function of each sequence's slot
count, so the mirror and the worker agree on how many blocks are free even though they
may hand out different physical ids.

Slots of one sequence, block_size = 4, 9 tokens in KV plus 2 lookahead slots (the KV
slots a step reserves past a sequence's tokens for its proposals)::

    block table:  [ 7 ][ 2 ][ 5 ]
    slots:        0..3  4..7  8  9 10 11
                  KV    KV    KV la la  (free)

``allocate_slots(seq, 9, num_lookahead=2)`` makes the sequence hold exactly the 3 blocks
11 slots need. After the target accepts one of the two lookahead tokens,
``allocate_slots(seq, 10)`` keeps ``blocks_needed(10, 4)`` = 3 blocks; stale slots past 10
are simply overwritten by the next step.

Prefix caching. A full block of committed tokens whose K/V is written is cached under a
key (``cache_blocks``). A block is in one of three states::

    used        ref > 0: in one or more tables (a shared block is read, never written)
    evictable   ref == 0, keyed: free, and still a hit until it is taken for new content
    empty       ref == 0, no key

A newcomer whose first blocks' keys are cached starts with those blocks in its table
(``allocate_slots(..., hits=...)``: their ``ref`` goes up) and computes only the rest.
New blocks come from the empty ones, then from the evictable ones least recently used
first (their key is forgotten then: an eviction). A freed table releases its blocks last
first, so of one sequence the block holding the most context is evicted first.

Keys, mirror and worker. The driver's mirror keys its blocks by the hash of their content
(``specray.scheduler.prefix_cache``) and is the one that decides hits and evictions. A
worker cannot see hashes and hands out its own ids, so the driver names a cached block to
it by the mirror's id of that block (its *name*): the mirror logs, for the next plan, each
block it cached (sequence, table index, name), each name it evicted and each newcomer's hit
names (``take_events``, ``take_hits``); the worker's pool (``explicit_evictions=True``)
keys its blocks by those names, evicts only the names it is told and takes new blocks only
from its empty ones. Applied in order, both pools hold the same keys and the same counts.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field


def blocks_needed(num_slots: int, block_size: int) -> int:
    """Blocks that hold ``num_slots`` slots: the one place the rounding up is written."""
    return -(-num_slots // block_size)


@dataclass
class CacheEvents:
    """What a mirror cached and evicted since a plan last took its events, in order: block
    ``cached_index[j]`` of sequence ``cached_seq_ids[j]`` now holds the content named
    ``cached_names[j]``; ``evicted_names`` are forgotten. ``uncached_all``: every key was
    forgotten first (a failed step: what its plans told a worker is not known)."""

    uncached_all: bool = False
    cached_seq_ids: list[int] = field(default_factory=list)
    cached_index: list[int] = field(default_factory=list)
    cached_names: list[int] = field(default_factory=list)
    evicted_names: list[int] = field(default_factory=list)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False,
                 named_by_driver: bool = False) -> None:
        """``named_by_driver``: a worker's pool, whose keys are the names the driver's
        mirror gives: it evicts only what it is told (``evict``) and logs nothing."""
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size <= 0:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.named_by_driver = named_by_driver
        self._ref = [0] * num_blocks
        self._key: list[Hashable | None] = [None] * num_blocks
        self._cached: dict[Hashable, int] = {}              # key -> the block holding that content
        # Empty blocks. Popping from the end hands out low ids first, which keeps small
        # tests readable.
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._evictable: OrderedDict[int, None] = OrderedDict()   # least recently used first
        self._tables: dict[int, list[int]] = {}
        self._num_keyed: dict[int, int] = {}     # per sequence: leading blocks cache_blocks has seen
        self._hits: dict[int, list[int]] = {}    # per newcomer: its hit names, until a plan takes them
        self._events = CacheEvents()

    # -- queries -------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks no table holds: the empty ones and the evictable ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_empty_blocks(self) -> int:
        """Free blocks holding no cached content (a worker's pool takes new blocks only from these)."""
        return len(self._free)

    def is_evictable(self, block: int) -> bool:
        return block in self._evictable

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks holding a keyed content, in tables or evictable."""
        return len(self._cached)

    def blocks_needed(self, num_slots: int) -> int:
        return blocks_needed(num_slots, self.block_size)

    def block_table(self, seq_id: int) -> list[int]:
        return self._tables.get(seq_id, [])

    def has(self, seq_id: int) -> bool:
        return seq_id in self._tables

    def is_cached(self, key: Hashable) -> bool:
        return key in self._cached

    def cached_prefix(self, keys: Sequence[Hashable]) -> int:
        """How many of ``keys`` (a sequence's full blocks, block 0 first) are cached, from
        block 0 on. Changes nothing."""
        n = 0
        for key in keys:
            if key not in self._cached:
                break
            n += 1
        return n

    def can_allocate_slots(self, seq_id: int, num_tokens: int, num_lookahead: int = 0,
                           hits: Sequence[Hashable] = ()) -> bool:
        """Whether ``allocate_slots`` with these arguments would succeed (shrinking always does)."""
        return self._growth(seq_id, num_tokens + num_lookahead, hits) is not None

    def _growth(self, seq_id: int, num_slots: int, hits: Sequence[Hashable]) -> tuple[list[int], int] | None:
        """The hit blocks a newcomer takes and the new blocks it needs, or None when they
        do not fit. A hit block that is evictable is no longer free once taken."""
        have = len(self._tables.get(seq_id, ()))
        blocks = [self._cached[key] for key in hits]
        new = self.blocks_needed(num_slots) - have - len(blocks)
        if new < 0 and blocks:
            raise ValueError(f"sequence {seq_id}: {len(blocks)} hit blocks for {num_slots} slots")
        taken = sum(1 for b in blocks if self._ref[b] == 0)
        takeable = len(self._free) + (0 if self.named_by_driver else len(self._evictable) - taken)
        if new > takeable:
            return None
        return blocks, new

    # -- operations ----------------------------------------------------------------
    def allocate_slots(self, seq_id: int, num_tokens: int, num_lookahead: int = 0,
                       hits: Sequence[Hashable] = ()) -> bool:
        """Make the sequence hold exactly the blocks its ``num_tokens`` tokens and
        ``num_lookahead`` lookahead slots need (vLLM's signature): blocks past them go back
        to the pool, missing ones are taken from it. ``hits``: for a sequence that holds no
        block yet, the keys of the cached blocks it starts with (all cached: see
        ``cached_prefix``). All or nothing: returns False (and changes nothing) when the
        pool cannot hold them; the caller preempts or waits."""
        if num_tokens < 0 or num_lookahead < 0:
            raise ValueError(f"negative slot count: {num_tokens} tokens, {num_lookahead} lookahead")
        if hits and self._tables.get(seq_id):
            raise ValueError(f"sequence {seq_id} already holds blocks: hits are for newcomers")
        fit = self._growth(seq_id, num_tokens + num_lookahead, hits)
        if fit is None:
            return False
        blocks, new = fit
        table = self._tables.get(seq_id)
        if table is None:
            table = self._tables[seq_id] = []
            self._num_keyed[seq_id] = 0
        for b in blocks:
            self._touch(b)
            table.append(b)
        if blocks:
            self._num_keyed[seq_id] = len(blocks)
            if not self.named_by_driver:
                self._hits[seq_id] = list(blocks)
        if new < 0:
            self._release(table[new:])
            del table[new:]
            self._num_keyed[seq_id] = min(self._num_keyed[seq_id], len(table))
        for _ in range(new):
            table.append(self._take())
        return True

    def free(self, seq_id: int) -> int:
        """Release the sequence's blocks (a shared one stays with its other holders; a
        cached one stays a hit until it is taken). Returns how many it held."""
        table = self._tables.pop(seq_id, None)
        self._num_keyed.pop(seq_id, None)
        self._hits.pop(seq_id, None)
        if table is None:
            return 0
        self._release(table)
        return len(table)

    def cache_blocks(self, seq_id: int, keys: Sequence[Hashable]) -> int:
        """The mirror's registration: the sequence's first ``len(keys)`` blocks hold
        committed tokens whose K/V is written, and these are their contents' keys. A key
        already cached in another block leaves this block uncached (both hold the same
        content; tables are never rewritten). Each block cached is logged for the worker
        under its name (its id here). Returns how many this call cached."""
        table = self._tables.get(seq_id)
        if not self.enable_prefix_caching or table is None:
            return 0
        if len(keys) > len(table):
            raise ValueError(f"sequence {seq_id}: {len(keys)} keys for a table of {len(table)} blocks")
        start = self._num_keyed[seq_id]
        added = 0
        for j in range(start, len(keys)):
            b, key = table[j], keys[j]
            if self._key[b] is not None:
                if self._key[b] != key:
                    raise AssertionError(f"block {b} of sequence {seq_id} is cached with another content")
                continue
            if key in self._cached:
                continue
            self._set_key(b, key)
            ev = self._events
            ev.cached_seq_ids.append(seq_id)
            ev.cached_index.append(j)
            ev.cached_names.append(b)
            added += 1
        self._num_keyed[seq_id] = max(start, len(keys))
        return added

    def cache_block(self, seq_id: int, index: int, name: Hashable) -> None:
        """A worker's registration: block ``index`` of the sequence's table holds the
        content the driver names ``name``."""
        b = self._tables[seq_id][index]
        if self._key[b] == name:
            return
        if self._key[b] is not None or name in self._cached:
            raise RuntimeError(f"the driver caches block {index} of sequence {seq_id} as {name!r}, this pool "
                               "already holds that block or that name: its mirror disagrees with this worker")
        self._set_key(b, name)

    def evict(self, name: Hashable) -> None:
        """A worker's eviction: forget the content named ``name`` (free: no table holds it)."""
        b = self._cached.get(name)
        if b is None or self._ref[b]:
            raise RuntimeError(f"the driver evicts {name!r}, which this pool holds "
                               f"{'in a table' if b is not None else 'nowhere'}: its mirror disagrees")
        del self._evictable[b]
        del self._cached[name]
        self._key[b] = None
        self._free.append(b)

    def uncache_all(self) -> None:
        """Forget every key (tables are kept). Logged for the worker in the mirror."""
        for b in self._evictable:
            self._free.append(b)
        self._evictable.clear()
        self._cached.clear()
        self._key = [None] * self.num_blocks
        for sid in self._num_keyed:
            self._num_keyed[sid] = 0
        self._hits.clear()
        self._events = CacheEvents(uncached_all=True)

    def take_events(self) -> CacheEvents:
        """The mirror's log since the last call (the next plan to its worker carries it)."""
        events, self._events = self._events, CacheEvents()
        return events

    def take_hits(self, seq_id: int) -> list[int]:
        """The names of the newcomer's hit blocks, once: its first plan carries them."""
        return self._hits.pop(seq_id, [])

    def has_pending_hits(self, seq_id: int) -> bool:
        return seq_id in self._hits

    def blocks_freed_by(self, seq_ids) -> list[int]:
        """The blocks that would become free if these sequences were freed (none shared
        with a sequence that stays). Changes nothing."""
        drop: dict[int, int] = {}
        for sid in set(seq_ids):
            for b in self._tables.get(sid, ()):
                drop[b] = drop.get(b, 0) + 1
        return [b for b, n in drop.items() if n == self._ref[b]]

    def block_of(self, key: Hashable) -> int | None:
        return self._cached.get(key)

    def key_of(self, block: int) -> Hashable | None:
        return self._key[block]

    def reset(self) -> None:
        """Forget every sequence and every cached block (the worker behind this pool
        restarted empty)."""
        self.__init__(self.num_blocks, self.block_size, self.enable_prefix_caching, self.named_by_driver)

    # -- internals -----------------------------------------------------------------
    def _set_key(self, b: int, key: Hashable) -> None:
        self._key[b] = key
        self._cached[key] = b

    def _take(self) -> int:
        """A block for new content: an empty one, else (the mirror) the least recently
        used evictable one, whose content is forgotten and the eviction logged."""
        if self._free:
            b = self._free.pop()
        else:
            if self.named_by_driver:
                raise RuntimeError("no empty block: the driver's mirror disagrees with this worker")
            b, _ = self._evictable.popitem(last=False)
            del self._cached[self._key[b]]
            self._key[b] = None
            self._events.evicted_names.append(b)
        self._ref[b] = 1
        return b

    def _touch(self, b: int) -> None:
        if self._ref[b] == 0:
            del self._evictable[b]
        self._ref[b] += 1

    def _release(self, blocks: list[int]) -> None:
        # Last first: of one sequence, the block holding the most context goes first.
        for b in reversed(blocks):
            self._ref[b] -= 1
            if self._ref[b] == 0:
                if self._key[b] is not None:
                    self._evictable[b] = None
                else:
                    self._free.append(b)

    def check_integrity(self) -> None:
        """free + used == total; every block's reference count is the number of tables
        holding it; evictable blocks are exactly the free keyed ones, empty ones the free
        unkeyed ones; the key map and the blocks' keys agree."""
        held = [0] * self.num_blocks
        for sid, table in self._tables.items():
            if len(table) != len(set(table)):
                raise AssertionError(f"sequence {sid} holds a block twice")
            for b in table:
                if not 0 <= b < self.num_blocks:
                    raise AssertionError(f"block id {b} out of range")
                held[b] += 1
        free = self._free + list(self._evictable)
        if any(not 0 <= b < self.num_blocks for b in free):
            raise AssertionError("block id out of range")
        if len(set(free)) != len(free):
            raise AssertionError("a free block is listed twice")
        used = sum(1 for n in held if n)
        if used + len(free) != self.num_blocks:
            raise AssertionError(f"free ({len(free)}) + used ({used}) != total ({self.num_blocks})")
        if any(held[b] for b in free):
            raise AssertionError("a block is both owned and free")
        if held != self._ref:
            bad = next(b for b in range(self.num_blocks) if held[b] != self._ref[b])
            raise AssertionError(f"block {bad} has ref {self._ref[bad]}, {held[bad]} tables hold it")
        if any(self._key[b] is not None for b in self._free):
            raise AssertionError("an empty block holds a key")
        if any(self._key[b] is None for b in self._evictable):
            raise AssertionError("an evictable block holds no key")
        if {b: k for k, b in self._cached.items()} != {b: k for b, k in enumerate(self._key) if k is not None}:
            raise AssertionError("the key map and the blocks' keys disagree")
        if not self.enable_prefix_caching and self._cached:
            raise AssertionError("blocks are cached with prefix caching off")
