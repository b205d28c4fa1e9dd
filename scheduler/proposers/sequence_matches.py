"""One sequence's matches against its own earlier tokens, for suffix decoding: the
proposal a ``SuffixTree`` holding just that sequence would make, without the tree.

A tree costs ``max_depth`` node visits per token to build, in Python, all on the step
that first sees a prompt; this index costs one list append per token: where each token
value occurred. A proposal reads the earlier occurrences of the
sequence's last token, measures how far back each matches the sequence's tail (at most
the tree's longest useful match, ``match_room``), and follows the continuations of those
that match longest, counting as the tree counts: a path of m tokens occurs once for every
position where it ends (the sequence's own end among them, with no continuation), a
continuation t once for each of those followed by t, and among equally frequent
continuations the one seen first wins, as the tree's insertion order makes it. The tree
test (tests/scheduler/proposers/test_sequence_matches.py) holds the two equal.

Its work grows with how often the last token occurred and how far those occurrences
match, not with the sequence's length: the tree's fixed O(max_depth) per token, traded
for a scan that is a few comparisons on text that does not repeat itself and one slice
comparison per occurrence on text that does, over at most the last ``RECENT``
occurrences (past that, the index counts fewer than the tree would).
"""

from __future__ import annotations

import sys

from specray.scheduler.proposers.suffix_tree import Candidate, match_room

# Bytes a token takes here, as CPython holds it: its slot in ``tokens``, its slot in a
# position list, and the position's int object. For metrics().
TOKEN_BYTES = 8 + 8 + sys.getsizeof(10**6)
# A distinct token value's position list and its entry in the map (a list grows by
# over-allocation, so this is its header and a typical spare).
VALUE_BYTES = sys.getsizeof([0]) + 3 * 8 + 8
# Earlier occurrences of the last token a proposal reads, the most recent first: a token
# seen more often (a model stuck repeating one token) counts only its last RECENT, where
# the tree would count them all, so that a step's scan stays bounded however often the
# sequence repeats one token.
RECENT = 256


class SequenceMatches:
    def __init__(self, max_depth: int) -> None:
        if max_depth < 2:
            raise ValueError(f"max_depth must be >= 2, got {max_depth}")
        self.max_depth = max_depth
        self.tokens: list[int] = []
        self._where: dict[int, list[int]] = {}      # token value -> its positions, ascending

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def num_bytes(self) -> int:
        return len(self.tokens) * TOKEN_BYTES + len(self._where) * VALUE_BYTES

    def extend(self, tokens: list[int]) -> None:
        where = self._where
        for i, t in enumerate(tokens, len(self.tokens)):
            pos = where.get(t)
            if pos is None:
                where[t] = [i]
            else:
                pos.append(i)
        self.tokens += tokens

    def speculate(self, max_tokens: int, min_prob: float, factor: float) -> Candidate | None:
        """What ``SuffixTree.speculate(tokens, ...)`` returns for a tree of this sequence
        alone: the continuation of the longest match that continues, a match of m tokens
        proposing at most ``min(max_tokens, m * factor)``, nothing past a path chance below
        ``min_prob``. None when no earlier occurrence continues."""
        seq, depth = self.tokens, self.max_depth
        if max_tokens <= 0 or not seq:
            return None
        last = len(seq) - 1
        longest = min(len(seq), depth - 1, match_room(depth, max_tokens, factor))
        reach: dict[int, list[int]] = {}            # match length -> earlier ends matching that far
        tail = seq[last - longest + 1:]
        for end in self._where[seq[last]][-RECENT - 1:-1]:
            if end + 1 >= longest and seq[end - longest + 1:end + 1] == tail:
                m = longest                          # a repeat: one comparison in C
            else:
                m = 1
                while m < longest and m <= end and seq[end - m] == seq[last - m]:
                    m += 1
            reach.setdefault(m, []).append(end)
        # Lengths between two that occur hold the same ends as the longer one, which
        # failed already, so only the occurring lengths are tried, longest first.
        ends: list[int] = []
        for m in sorted(reach, reverse=True):
            limit = min(max_tokens, int(m * factor + 1e-9))
            if limit <= 0:
                return None                          # shorter matches may propose less still
            ends = sorted(ends + reach[m])
            cand = self._follow(ends + [last], m, limit, min_prob)
            if cand is not None:
                return cand
        return None

    def _follow(self, ends: list[int], m: int, limit: int, min_prob: float) -> Candidate | None:
        """From the path of m tokens ending at ``ends`` (ascending), the continuation seen
        most often, token by token, while the path's chance stays at least ``min_prob``."""
        seq, last = self.tokens, len(self.tokens) - 1
        tokens, chances, p = [], [], 1.0
        while len(tokens) < limit and m + len(tokens) < self.max_depth:
            seen: dict[int, int] = {}
            for end in ends:
                if end < last:
                    t = seq[end + 1]
                    seen[t] = seen.get(t, 0) + 1
            if not seen:
                break
            t, c = max(seen.items(), key=lambda tc: tc[1])
            p *= c / len(ends)
            if p < min_prob:
                break
            tokens.append(t)
            chances.append(p)
            ends = [end + 1 for end in ends if end < last and seq[end + 1] == t]
        return Candidate(tokens, chances, m) if tokens else None
