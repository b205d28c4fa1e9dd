"""Prompt-lookup proposals: the lookup rule against a brute-force reference, and the
per-sequence history kept under the same num_computed invariant as a draft's KV cache."""

from __future__ import annotations

import random

import pytest

from specray.scheduler.config import SpeculationConfig
from specray.scheduler.proposers.ngram import NgramProposer


def ngram(max_ngram: int = 3, min_ngram: int = 1) -> NgramProposer:
    return NgramProposer(SpeculationConfig(proposer="ngram", ngram_max=max_ngram, ngram_min=min_ngram))


def reference_lookup(hist, k, max_ngram, min_ngram):
    """Brute force: for the longest suffix n-gram with an earlier occurrence, the latest
    such occurrence (it may overlap the suffix) and up to k tokens after it."""
    if k <= 0:
        return []
    for n in range(max_ngram, min_ngram - 1, -1):
        if n >= len(hist):
            continue
        suffix = hist[-n:]
        starts = [s for s in range(len(hist) - n) if hist[s:s + n] == suffix]
        if starts:
            s = max(starts)
            return hist[s + n:s + n + k]
    return []


@pytest.mark.parametrize("hist, k, expect", [
    ([1, 2, 3, 4, 1, 2, 3], 3, [4, 1, 2]),
    ([1, 2, 3, 9, 1, 2, 3, 8, 5, 1, 2, 3], 3, [8, 5, 1]),     # the most recent occurrence
    ([7, 1, 2, 5, 9, 2, 6, 1, 2], 3, [5, 9, 2]),               # longest n-gram beats a newer shorter one
    ([4, 5, 6, 1, 3, 6], 3, [1, 3, 6]),                        # falls back to a 1-gram
    ([1, 2, 3, 4, 1, 2, 3], 1, [4]),                           # capped at k
    ([1, 2, 1], 5, [2, 1]),                                    # continuation shorter than k
    ([5, 5, 5, 5], 3, [5]),                                    # overlapping match
    ([1, 2, 3, 4], 3, []),                                     # no match
    ([1, 2, 3, 1], 0, []),                                     # k = 0
    ([], 3, []),
    ([8], 3, []),
])
def test_lookup_cases(hist, k, expect):
    assert ngram(3, 1).lookup(list(hist), k) == expect


def test_lookup_min_ngram():
    p = ngram(3, 2)
    assert p.lookup([4, 5, 6, 1, 3, 6], 3) == []           # only a 1-gram matches
    assert p.lookup([4, 5, 6, 1, 5, 6], 3) == [1, 5, 6]
    with pytest.raises(ValueError, match="ngram_min <= ngram_max"):
        ngram(1, 2)
    with pytest.raises(ValueError, match="ngram_min <= ngram_max"):
        ngram(2, 0)


@pytest.mark.parametrize("max_ngram, min_ngram", [(3, 1), (4, 2), (1, 1)])
def test_lookup_matches_brute_force(max_ngram, min_ngram):
    rng = random.Random(max_ngram * 10 + min_ngram)
    p = ngram(max_ngram, min_ngram)
    for _ in range(400):
        hist = [rng.randrange(4) for _ in range(rng.randrange(0, 25))]
        k = rng.randrange(0, 6)
        assert p.lookup(list(hist), k) == reference_lookup(hist, k, max_ngram, min_ngram), (hist, k)


def test_lookup_does_not_modify_history():
    hist = [1, 2, 3, 1, 2]
    ngram().lookup(hist, 3)
    assert hist == [1, 2, 3, 1, 2]


def _rows(props):
    return [props.token_ids[i * props.width:(i + 1) * props.width] for i in range(len(props.seq_ids))]


def test_propose_keeps_history_like_a_draft_cache(plan_builder):
    prop = ngram(3, 1)
    a = [1, 2, 3, 4, 1, 2, 3]
    b = [9, 8, 7, 6]                      # no repetition: nothing to propose
    c = [5, 6, 5]
    plan = plan_builder([0, 1, 2], [0, 0, 0], [7, 4, 3], a + b + c, [9, 6, 4], width=3, proposal_lens=[3, 3, 2])
    props, probs = prop.propose(plan)
    props.validate()
    assert probs is None and not props.has_probs
    assert props.seq_ids == [0, 1, 2]
    assert props.proposal_lens == [3, 0, 2]               # found lengths, may be below k_i
    assert _rows(props) == [[4, 1, 2], [-1, -1, -1], [6, 5, -1]]
    # Like a draft's KV: the fed tokens plus all proposals but the last.
    assert prop.history == {0: a + [4, 1], 1: b, 2: c + [6]}

    # Target verdicts and what the driver then counts as cached (L + min(accepted, k_i - 1)):
    # seq 0 accepts 1 and recovers 9 (cached L + 1: the stale proposal "1" must go),
    # seq 1 had nothing and emits 2 (cached L), seq 2 accepts 1 of 2 and recovers 7 (cached L + 1).
    a2, b2, c2 = a + [4, 9], b + [2], c + [6, 7]
    plan = plan_builder([0, 1, 2], [8, 4, 4], [1, 1, 1], [9, 2, 7], [11, 7, 7], width=3, proposal_lens=[3, 3, 3])
    props, _ = prop.propose(plan)
    props.validate()
    for i, (sid, h) in enumerate(((0, a2), (1, b2), (2, c2))):
        found = reference_lookup(h, 3, 3, 1)
        assert props.proposal_lens[i] == len(found)
        assert _rows(props)[i] == found + [-1] * (3 - len(found))
        assert prop.history[sid] == h + found[:-1]

    # A recomputed sequence (preempted and readmitted) feeds everything again from 0.
    plan = plan_builder([1], [0], [5], b2, [7], width=3, proposal_lens=[3])
    prop.propose(plan)
    assert prop.history[1] == b2

    # Frees drop history, before the step's sequences are handled.
    plan = plan_builder([2], [len(c2)], [1], [6], [len(c2) + 3], width=3, proposal_lens=[3], free_seq_ids=[0, 1])
    prop.propose(plan)
    assert set(prop.history) == {2}
    assert prop.history[2][:len(c2) + 1] == c2 + [6]
    # A freed id that comes back starts empty: claiming cached tokens is an error.
    with pytest.raises(RuntimeError):
        prop.propose(plan_builder([0], [3], [1], [1], [7], width=3, proposal_lens=[3]))


def test_propose_rejects_num_computed_beyond_history(plan_builder):
    prop = ngram()
    prop.propose(plan_builder([4], [0], [3], [1, 2, 1], [5], width=3, proposal_lens=[3]))
    held = len(prop.history[4])
    with pytest.raises(RuntimeError):
        prop.propose(plan_builder([4], [held + 1], [1], [7], [held + 5], width=3, proposal_lens=[3]))
    with pytest.raises(RuntimeError):          # a sequence this proposer never saw
        prop.propose(plan_builder([5], [2], [1], [7], [6], width=3, proposal_lens=[3]))


def test_propose_zero_proposal_len(plan_builder):
    prop = ngram()
    props, _ = prop.propose(plan_builder([0], [0], [4], [1, 2, 1, 2], [4], width=2, proposal_lens=[0]))
    assert props.proposal_lens == [0] and props.token_ids == [-1, -1]
    assert prop.history[0] == [1, 2, 1, 2]
