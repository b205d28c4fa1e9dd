"""A suffix tree of token sequences, cut at ``max_depth`` tokens, with occurrence counts:
what suffix decoding looks continuations up in.

Every suffix of every sequence added is a path from the root, truncated at ``max_depth``
tokens; a node's ``count`` is how many (sequence, start) pairs pass through it, i.e. how
often its path occurs. For ``a b a b c`` and depth 3::

    root ─ a(2) ─ b(2) ─ a(1)          the suffixes a b a | b a b | a b c | b c | c,
         │           └── c(1)          each cut at 3 tokens
         ├ b(2) ─ a(1) ─ b(1)
         │      └ c(1)
         └ c(1)

A sequence grows one token at a time in O(depth): its *active* nodes are the paths of
its last 1..depth-1 tokens, and the new token extends each by one (``append``). Because
every suffix of an occurring path also occurs, the suffixes of a context that occur are
exactly its last 1..M tokens for one M, which ``longest_match`` finds by bisection.

``speculate`` follows, from the longest matched path that continues, the child seen
most often while the chance of the path so far (the product of child count over parent
count) stays at least ``min_prob``; its score is the sum of those chances, the expected
number of tokens a verifier accepts if the counts are right. (A request's own tokens are
matched by ``SequenceMatches``, which proposes what a tree of that one sequence would
without building it.)

Nodes are integer ids into flat arrays (counts in an ``array``, children in dicts of
``int -> int``), not one Python object each: a global tree holds hundreds of thousands
of nodes, and CPython's cyclic collector would walk every node object on each full
collection, in the middle of whatever step ran then (it halved suffix decoding's
tokens/s on the built-in pair). Dicts of ints and arrays are not tracked by the collector.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass
from functools import lru_cache

ROOT = 0


@dataclass
class Candidate:
    tokens: list[int]
    chances: list[float]      # per token, the chance of the path up to it
    match_len: int

    @property
    def score(self) -> float:
        """Tokens expected to be accepted: the sum of the path's chances."""
        return sum(self.chances)


@lru_cache(maxsize=None)
def match_room(max_depth: int, max_tokens: int, factor: float) -> int:
    """The longest match worth following when a match of m tokens may propose
    ``min(max_tokens, m * factor)`` and a path holds at most ``max_depth`` tokens (so
    ``max_depth - m`` past the match): the longest m that still reaches the most any m
    could propose. A long repeat is matched no further than that, so that its path has
    room to continue; with ``max_tokens`` at or past ``max_depth`` it still proposes (about
    ``max_depth / (1 + factor) * factor`` tokens a step)."""
    best = max(min(max_tokens, int(m * factor + 1e-9), max_depth - m) for m in range(1, max_depth))
    return max_depth - best if best > 0 else max_depth - 1


class SuffixTree:
    def __init__(self, max_depth: int) -> None:
        if max_depth < 2:
            raise ValueError(f"max_depth must be >= 2, got {max_depth}")
        self.max_depth = max_depth
        self.num_nodes = 0                        # not counting the root
        self.num_tokens = 0
        self._count = array("q", [0])             # node id -> occurrences of its path
        self._children: list[dict[int, int] | None] = [None]   # node id -> token -> child id
        self._free: list[int] = []                # ids of removed nodes, for reuse
        self._seqs: dict[object, list[int]] = {}
        self._active: dict[object, list[int]] = {}

    def tokens(self, key) -> list[int]:
        return self._seqs[key]

    def count(self, path: list[int]) -> int:
        """How often ``path`` occurs (0: never)."""
        node = self._walk(path)
        return 0 if node is None else self._count[node]

    def extend(self, key, tokens: list[int]) -> None:
        """Append ``tokens`` to sequence ``key`` (a new one when unknown)."""
        seq = self._seqs.setdefault(key, [])
        active = self._active.setdefault(key, [])
        keep = self.max_depth - 1
        count, children, free = self._count, self._children, self._free
        created = 0
        for t in tokens:
            nxt = []
            for node in [ROOT, *active[:keep]]:
                kids = children[node]
                if kids is None:
                    kids = children[node] = {}
                child = kids.get(t)
                if child is None:
                    # a new node (inlined: this loop is most of suffix decoding's cost)
                    if free:
                        child = free.pop()
                    else:
                        child = len(count)
                        count.append(0)
                        children.append(None)
                    kids[t] = child
                    created += 1
                count[child] += 1
                nxt.append(child)
            active = nxt
        seq += tokens
        self._active[key] = active
        self.num_nodes += created
        self.num_tokens += len(tokens)

    def remove(self, key) -> None:
        """Forget sequence ``key``: every path it added loses one count, and nodes left at
        zero go."""
        seq = self._seqs.pop(key, None)
        self._active.pop(key, None)
        if seq is None:
            return
        self.num_tokens -= len(seq)
        count, children = self._count, self._children
        for start in range(len(seq)):
            node = ROOT
            for t in seq[start:start + self.max_depth]:
                child = children[node][t]
                count[child] -= 1
                if count[child] == 0:
                    del children[node][t]
                    self._drop(child)
                    break
                node = child

    def longest_match(self, context: list[int]) -> int:
        """The most trailing tokens of ``context`` (at most ``max_depth - 1``, leaving room
        to continue) that occur as a path."""
        lo, hi = 0, min(len(context), self.max_depth - 1)
        while lo < hi:                        # the largest m whose path exists
            mid = (lo + hi + 1) // 2
            if self._walk(context[len(context) - mid:]) is not None:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def speculate(self, context: list[int], max_tokens: int, min_prob: float, factor: float) -> Candidate | None:
        """The continuation of ``context``'s longest match that continues (at most
        ``match_room`` tokens, so that a path has room to continue): a match of m tokens
        may propose ``min(max_tokens, m * factor)`` tokens (longer matches are trusted
        further); a match whose first token's chance is below ``min_prob`` (or that was
        only ever followed by a sequence's end) gives way to the next shorter one. None
        when nothing matches or nothing passes ``min_prob``."""
        if max_tokens <= 0:
            return None
        room = match_room(self.max_depth, max_tokens, factor)
        longest = self.longest_match(context[max(len(context) - room, 0):])
        return self._follow(range(longest, 0, -1),
                            lambda m: self._walk(context[len(context) - m:]), max_tokens, min_prob, factor)

    def _follow(self, lengths, node_of, max_tokens: int, min_prob: float, factor: float) -> Candidate | None:
        count, children = self._count, self._children
        for m in lengths:
            limit = min(max_tokens, int(m * factor + 1e-9))
            if limit <= 0:
                return None                   # shorter matches may propose less still
            node = node_of(m)
            tokens, chances, p = [], [], 1.0
            while len(tokens) < limit and children[node]:
                t, child = max(children[node].items(), key=lambda kv: count[kv[1]])
                p *= count[child] / count[node]
                if p < min_prob:
                    break
                tokens.append(t)
                chances.append(p)
                node = child
            if tokens:
                return Candidate(tokens, chances, m)
        return None

    def _walk(self, path: list[int]) -> int | None:
        node, children = ROOT, self._children
        for t in path:
            kids = children[node]
            node = kids.get(t) if kids else None
            if node is None:
                return None
        return node

    def _drop(self, node: int) -> None:
        """Free ``node`` and its subtree (already unlinked from its parent)."""
        stack = [node]
        while stack:
            x = stack.pop()
            kids = self._children[x]
            if kids:
                stack.extend(kids.values())
            self._children[x] = None
            self._count[x] = 0
            self._free.append(x)
            self.num_nodes -= 1

    def check_integrity(self) -> None:
        """Counts and node totals as the stored sequences imply (tests call it)."""
        expect: dict[tuple, int] = {}
        for seq in self._seqs.values():
            for start in range(len(seq)):
                for end in range(start + 1, min(len(seq), start + self.max_depth) + 1):
                    path = tuple(seq[start:end])
                    expect[path] = expect.get(path, 0) + 1
        found: dict[tuple, int] = {}
        stack = [((), ROOT)]
        while stack:
            path, node = stack.pop()
            for t, child in (self._children[node] or {}).items():
                found[path + (t,)] = self._count[child]
                stack.append((path + (t,), child))
        if found != expect:
            raise AssertionError("suffix tree counts differ from its sequences")
        if len(found) != self.num_nodes or sum(map(len, self._seqs.values())) != self.num_tokens:
            raise AssertionError("suffix tree totals are off")
        if len(self._free) + self.num_nodes + 1 != len(self._count):
            raise AssertionError("suffix tree node ids leak")
