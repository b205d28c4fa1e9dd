"""SuffixTree against brute force: counts of every path, the longest match, removal, and
what a speculation follows and stops at."""

from __future__ import annotations

import random

import pytest

from specray.scheduler.proposers.suffix_tree import SuffixTree


def occurrences(seqs: list[list[int]], path: list[int]) -> int:
    n = len(path)
    return sum(1 for s in seqs for i in range(len(s) - n + 1) if s[i:i + n] == path)


def test_the_docstring_example():
    t = SuffixTree(3)
    t.extend("x", [1, 2, 1, 2, 3])
    t.check_integrity()
    assert t.count([1]) == 2 and t.count([1, 2]) == 2
    assert t.count([1, 2, 1]) == 1 and t.count([1, 2, 3]) == 1
    assert t.count([2, 1, 2]) == 1 and t.count([2, 3]) == 1 and t.count([3]) == 1
    assert t.count([1, 2, 1, 2]) == 0 and t.count([3, 1]) == 0        # cut at depth 3; never seen
    assert t.num_nodes == 9 and t.num_tokens == 5


def test_random_growth_and_removal_keep_every_count_exact():
    rng = random.Random(1)
    t = SuffixTree(5)
    seqs: dict[int, list[int]] = {}
    for step in range(300):
        key = rng.randrange(6)
        if rng.random() < 0.15 and key in seqs:
            t.remove(key)
            del seqs[key]
        else:
            toks = [rng.randrange(4) for _ in range(rng.randrange(1, 4))]
            t.extend(key, toks)
            seqs.setdefault(key, []).extend(toks)
        if step % 25 == 0:
            t.check_integrity()
    t.check_integrity()
    for key in list(seqs):
        t.remove(key)
    assert t.num_nodes == 0 and t.num_tokens == 0 and t.count([]) == 0 and t.longest_match([1, 2]) == 0


def test_longest_match_is_the_most_trailing_tokens_that_occur():
    rng = random.Random(2)
    for _ in range(200):
        seqs = [[rng.randrange(3) for _ in range(rng.randrange(1, 12))] for _ in range(2)]
        t = SuffixTree(6)
        for i, s in enumerate(seqs):
            t.extend(i, s)
        context = [rng.randrange(3) for _ in range(rng.randrange(0, 9))]
        expect = max((m for m in range(0, min(len(context), 5) + 1)
                      if m == 0 or occurrences(seqs, context[len(context) - m:])), default=0)
        assert t.longest_match(context) == expect


def test_speculation_follows_the_continuation_seen_most_often():
    t = SuffixTree(8)
    for i, tail in enumerate(([7, 8], [7, 8], [7, 9])):
        t.extend(i, [1, 2, 3] + tail)
    got = t.speculate([5, 1, 2, 3], max_tokens=4, min_prob=0.1, factor=1.0)
    assert got.tokens == [7, 8] and got.match_len == 3
    assert got.score == pytest.approx(1.0 + 2 / 3)      # 3/3 went on to 7, then 2 of 3 to 8
    # A chance below min_prob stops the path; a short match proposes little.
    assert t.speculate([5, 1, 2, 3], 4, min_prob=0.7, factor=1.0).tokens == [7]
    assert t.speculate([9, 9, 3], 4, min_prob=0.1, factor=1.0).tokens == [7]
    assert t.speculate([9, 9, 3], 4, min_prob=0.1, factor=2.0).tokens == [7, 8]
    assert t.speculate([4, 4], 4, 0.1, 1.0) is None                  # no match at all
    assert t.speculate([5, 1, 2, 3], 0, 0.1, 1.0) is None            # nothing asked for


def test_a_long_match_leaves_the_path_room_to_continue():
    t = SuffixTree(6)
    t.extend(0, list(range(12)))
    got = t.speculate(list(range(8)), max_tokens=3, min_prob=0.1, factor=1.0)
    assert got.tokens == [8, 9, 10] and got.match_len == 3      # not 5 tokens matched and 1 proposed


def test_a_sequence_matches_its_own_earlier_occurrences():
    t = SuffixTree(6)
    t.extend("own", [4, 5, 6, 1, 4, 5])
    got = t.speculate(t.tokens("own"), max_tokens=3, min_prob=0.1, factor=1.0)
    # "4 5" occurred before, followed by "6 1 4"; its current end has no continuation.
    assert got.tokens == [6, 1] and got.score == pytest.approx(0.5 + 0.5)


def test_bad_depth_is_refused():
    with pytest.raises(ValueError, match="max_depth"):
        SuffixTree(1)


def reference_speculation(seqs: list[list[int]], depth: int, context: list[int], k: int, min_prob: float,
                          factor: float):
    """What ``speculate`` may return, by counting occurrences in the sequences themselves:
    the match length it must pick and, per proposed token, the counts it must choose from.
    Ties between continuations seen equally often may go either way, so the caller checks
    the path it got against ``reference_path``."""
    def proposable(m: int) -> int:
        return min(k, int(m * factor + 1e-9), depth - m)

    best = max(proposable(m) for m in range(1, depth))
    room = max(m for m in range(1, depth) if proposable(m) == best) if best > 0 else depth - 1
    for m in range(min(room, len(context)), 0, -1):
        path = context[len(context) - m:]
        if not occurrences(seqs, path) or proposable(m) <= 0:
            continue
        if reference_path(seqs, depth, path, [], proposable(m), min_prob) is not None:
            return m
    return None


def reference_path(seqs, depth, matched, proposed, limit, min_prob):
    """None where ``proposed`` cannot be the walk from ``matched`` (a token not among the
    continuations seen most often, a chance below ``min_prob``, a path past ``depth``, or a
    stop while a continuation passes), else the chances along it. With ``proposed`` empty:
    whether a first token passes at all (None: none does)."""
    chances, p, path = [], 1.0, list(matched)
    for j in range(limit + 1):
        if len(path) >= depth:
            break
        nxt = {}
        for t in {s[i + len(path)] for s in seqs for i in range(len(s) - len(path))
                  if s[i:i + len(path)] == path}:
            nxt[t] = occurrences(seqs, path + [t])
        if not nxt:
            break
        top = max(nxt.values())
        passes = p * top / occurrences(seqs, path) >= min_prob
        if j == len(proposed):
            # The walk stopped here: only right if it had to (limit reached or no chance passes).
            if not proposed:
                return [] if passes else None
            return chances if (j == limit or not passes) else None
        if nxt.get(proposed[j]) != top or not passes:
            return None
        p *= top / occurrences(seqs, path)
        chances.append(p)
        path.append(proposed[j])
    if not proposed:
        return None                       # nothing follows the match at all
    return chances if len(proposed) == len(chances) else None


def test_speculation_against_brute_force_counts():
    rng = random.Random(4)
    for trial in range(400):
        depth = rng.choice([4, 6, 9])
        seqs = [[rng.randrange(3) for _ in range(rng.randrange(1, 16))] for _ in range(rng.randrange(1, 4))]
        t = SuffixTree(depth)
        for i, s in enumerate(seqs):
            t.extend(i, s)
        context = [rng.randrange(3) for _ in range(rng.randrange(0, 10))]
        k, min_prob, factor = rng.randrange(1, 12), rng.choice([0.05, 0.3, 0.6]), rng.choice([0.5, 1.0, 2.0])
        got = t.speculate(context, k, min_prob, factor)
        m = reference_speculation(seqs, depth, context, k, min_prob, factor)
        if m is None:
            assert got is None, trial
            continue
        assert got is not None and got.match_len == m, trial
        limit = min(k, int(m * factor + 1e-9), depth - m)
        chances = reference_path(seqs, depth, context[len(context) - m:], got.tokens, limit, min_prob)
        assert chances is not None and 1 <= len(got.tokens) <= limit, trial
        assert got.score == pytest.approx(sum(chances)), trial


def test_many_tokens_asked_of_a_shallow_tree_still_propose():
    t = SuffixTree(24)
    t.extend(0, list(range(60)))
    for k, want in ((4, 4), (16, 12), (24, 12), (32, 12)):
        got = t.speculate(list(range(30)), max_tokens=k, min_prob=0.1, factor=1.0)
        assert len(got.tokens) == want and got.tokens == list(range(30, 30 + want)), k
    got = t.speculate(list(range(30)), max_tokens=32, min_prob=0.1, factor=2.0)
    assert got.tokens == list(range(30, 46)) and got.match_len == 8        # 8 matched, 16 proposed
