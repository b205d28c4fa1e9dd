"""SequenceMatches against the SuffixTree it stands in for: a tree holding only the
sequence proposes exactly what the index does, token for token and score for score."""

from __future__ import annotations

import random
import sys
import tracemalloc

import pytest

from specray.scheduler.proposers.sequence_matches import RECENT, SequenceMatches
from specray.scheduler.proposers.suffix_tree import SuffixTree


def tree_of(depth: int, toks: list[int]) -> SuffixTree:
    t = SuffixTree(depth)
    t.extend("own", toks)
    return t


@pytest.mark.parametrize("alphabet", [2, 4, 12])
def test_it_proposes_what_a_tree_of_the_sequence_proposes(alphabet):
    rng = random.Random(alphabet)
    for _ in range(400):
        depth = rng.choice([2, 3, 5, 8, 24])
        toks = [rng.randrange(alphabet) for _ in range(rng.randrange(0, 60))]
        if rng.random() < 0.3 and toks:                       # a repeat, as code and quotes have
            toks += toks[rng.randrange(len(toks)):][:rng.randrange(1, 30)]
        idx = SequenceMatches(depth)
        cut = rng.randrange(len(toks) + 1)
        idx.extend(toks[:cut])
        idx.extend(toks[cut:])                              # grown in two steps, as a request is
        args = (rng.randrange(0, 30), rng.choice([0.05, 0.3, 0.6, 1.0]), rng.choice([0.3, 0.5, 1.0, 2.0]))
        assert idx.speculate(*args) == tree_of(depth, toks).speculate(toks, *args), (depth, toks, args)


def test_ties_go_to_the_continuation_seen_first():
    toks = [1, 7, 2, 1, 5, 3, 1]                      # "1" was followed by 7, then by 5: one each
    idx = SequenceMatches(8)
    idx.extend(toks)
    got = idx.speculate(1, 0.01, 1.0)
    assert got.tokens == [7] and got.score == pytest.approx(1 / 3)   # its own end counts, unfollowed
    assert got == tree_of(8, toks).speculate(toks, 1, 0.01, 1.0)


def test_a_token_repeated_past_the_scan_bound_still_proposes_the_repeat():
    toks = [9, 4] + [5] * (RECENT * 4)            # a model stuck on one token
    idx = SequenceMatches(24)
    idx.extend(toks)
    got, tree = idx.speculate(4, 0.1, 1.0), tree_of(24, toks).speculate(toks, 4, 0.1, 1.0)
    assert got.tokens == tree.tokens == [5] * 4 and got.match_len == tree.match_len
    assert got.score == pytest.approx(tree.score, rel=0.05)   # counted over the last RECENT only


def test_nothing_is_proposed_without_an_earlier_continuation():
    idx = SequenceMatches(6)
    assert idx.speculate(4, 0.1, 1.0) is None
    idx.extend([3, 4, 5])
    assert idx.speculate(4, 0.1, 1.0) is None
    assert idx.speculate(0, 0.1, 1.0) is None


def test_the_reported_bytes_are_what_the_index_takes():
    rng = random.Random(1)
    toks = [rng.randrange(5000) for _ in range(20_000)]
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        idx = SequenceMatches(24)
        for i in range(0, len(toks), 100):
            idx.extend(toks[i:i + 100])
        taken = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert 0.7 < idx.num_bytes / taken < 1.3, (idx.num_bytes, taken, sys.version)


def test_bad_depth_is_refused():
    with pytest.raises(ValueError, match="max_depth"):
        SequenceMatches(1)
