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
