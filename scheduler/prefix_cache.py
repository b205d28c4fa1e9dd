"""What names a full block of committed tokens in the prefix cache: a hash chain.

Block j of a sequence is named by ``H(name of block j - 1, tokens[jB:(j+1)B])``; block 0's
parent is the sequence's root, ``H(key, cache_salt)``: ``key`` says which models computed
the K/V (a runtime's model pair: a block of one pair is never a hit for another), and
``cache_salt`` (``SamplingParams.cache_salt``) keeps tenants who must not share apart. So a
name stands for the whole prefix up to the block's end, under one pair and one salt::

    root = H(key, salt)
    h0 = H(root, t0..t3)      h1 = H(h0, t4..t7)      h2 = H(h1, t8..t11)     (block_size 4)

Only committed tokens (the prompt and emitted tokens) are ever named: the scheduler names
a block once its tokens are part of the sequence and its K/V is written in a worker
(``Scheduler.update``), never a block of lookahead slots or unverified proposals.

BLAKE2b with a 16-byte digest: collisions are out of reach by chance (2^-64 at a billion
blocks) and by construction (no known attack), so a hit is a hit; hashlib is the standard
library's, fast enough (a 400-token prompt hashes in microseconds).
"""

from __future__ import annotations

import hashlib
from array import array

DIGEST_BYTES = 16


def root_hash(key: str, cache_salt: str | None) -> bytes:
    """The parent of a sequence's block 0: its model pair and its salt."""
    h = hashlib.blake2b(digest_size=DIGEST_BYTES, person=b"specray-root")
    h.update(key.encode())
    h.update(b"\x00")
    if cache_salt is not None:
        h.update(b"\x01")
        h.update(cache_salt.encode())
    return h.digest()


def block_hash(parent: bytes, tokens: list[int]) -> bytes:
    """The name of a full block of ``tokens`` after the prefix named ``parent``."""
    h = hashlib.blake2b(parent, digest_size=DIGEST_BYTES, person=b"specray-block")
    h.update(array("q", tokens).tobytes())
    return h.digest()


def extend_hashes(hashes: list[bytes], root: bytes, tokens: list[int], num_blocks: int, block_size: int) -> list[bytes]:
    """Grow ``hashes`` (a sequence's names, block 0 first) to its first ``num_blocks`` full
    blocks of ``tokens`` (in place; returns it). Names already there are kept: tokens
    below a sequence's length never change."""
    if num_blocks * block_size > len(tokens):
        raise ValueError(f"{num_blocks} full blocks of {block_size} need {num_blocks * block_size} tokens, "
                         f"the sequence has {len(tokens)}")
    for j in range(len(hashes), num_blocks):
        hashes.append(block_hash(hashes[j - 1] if j else root, tokens[j * block_size:(j + 1) * block_size]))
    return hashes


class PrefixCache:
    """The scheduler's side of prefix caching, one decision for every model: a sequence's
    hit is the run of its prompt's full blocks cached in its target pool and (``draft``
    given: a draft model holds KV for it) its draft pool. ``key`` names the models
    (``root_hash``); ``hit_margin``: blocks a hit gives back, for a head whose KV at a
    position depends on the next token (an EAGLE head reading the target's tables)."""

    def __init__(self, key: str, block_size: int, hit_margin: int = 0) -> None:
        if hit_margin < 0:
            raise ValueError(f"hit_margin must be >= 0, got {hit_margin}")
        self.key = key
        self.block_size = block_size
        self.hit_margin = hit_margin

    def hashes(self, seq, num_blocks: int) -> list[bytes]:
        """The names of the sequence's first ``num_blocks`` full blocks (kept on it)."""
        if len(seq.block_hashes) < num_blocks:
            extend_hashes(seq.block_hashes, root_hash(self.key, seq.params.cache_salt), seq.tokens, num_blocks,
                          self.block_size)
        return seq.block_hashes[:num_blocks]

    def lookup(self, seq, target, draft) -> int:
        """Blocks of a newcomer's tokens cached in both pools, at most all but its last
        token (the step needs that token's logits). Changes nothing."""
        hashes = self.hashes(seq, (seq.num_tokens - 1) // self.block_size)
        hit = target.cached_prefix(hashes)
        if draft is not None:
            hit = draft.cached_prefix(hashes[:hit])
        return max(hit - self.hit_margin, 0)

    def take_hits(self, seq, hit: int, target, draft) -> None:
        """Start a newcomer with its ``hit`` cached blocks in both pools, each model's
        ``num_computed`` their slots (taking cached blocks needs no new block: it fits)."""
        hashes = self.hashes(seq, hit)
        num_slots = hit * self.block_size
        if not target.allocate_slots(seq.seq_id, num_slots, hits=hashes):
            raise AssertionError(f"sequence {seq.seq_id}: its cached blocks did not fit")
        seq.target_computed = num_slots
        if draft is not None:
            if not draft.allocate_slots(seq.seq_id, num_slots, hits=hashes):
                raise AssertionError(f"sequence {seq.seq_id}: its cached draft blocks did not fit")
            seq.draft_computed = num_slots

    def register(self, seq, target, draft) -> None:
        """Name the sequence's full blocks of committed tokens whose K/V each worker wrote
        (the draft's only as far as it computed): never lookahead or unverified proposals."""
        for pool, computed in ((target, seq.target_computed), (draft, seq.draft_computed)):
            if pool is not None and pool.has(seq.seq_id):
                n = min(computed, seq.num_tokens) // self.block_size
                pool.cache_blocks(seq.seq_id, self.hashes(seq, n))
