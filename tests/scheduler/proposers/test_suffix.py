"""SuffixProposer: per-request trees, the global tree over finished requests (FIFO within
its request count and node budget), what it proposes and what it reports."""

from __future__ import annotations

import pytest

from specray.scheduler.config import SpeculationConfig
from specray.scheduler.proposal_choice import ScoreRecord
from specray.scheduler.proposers.suffix import SuffixProposer
from specray.scheduler.sampling_params import SamplingParams
from specray.scheduler.sequence import Sequence


def proposer(**kw) -> SuffixProposer:
    return SuffixProposer(SpeculationConfig(proposer="suffix", **kw))


def seq(sid: int, tokens: list[int], proposal_len: int = 4, prompt_len: int | None = None) -> Sequence:
    s = Sequence(seq_id=sid, request_id=str(sid), prompt_len=prompt_len or len(tokens), tokens=list(tokens),
                 params=SamplingParams(max_tokens=64), seed=sid)
    s.proposal_len = proposal_len
    return s


def rows(p):
    return [p.token_ids[i * p.width:i * p.width + n] for i, n in enumerate(p.proposal_lens)]


def test_a_finished_request_teaches_the_next_one():
    sp = proposer()
    first = seq(1, [10, 11, 12, 13, 14, 15, 16, 17], prompt_len=3)
    assert rows(sp.propose(1, [seq(2, [10, 11, 12])]))[0] == []     # nothing seen yet: nothing proposed
    sp.finished(first)
    p = sp.propose(2, [seq(2, [10, 11, 12], proposal_len=2), seq(3, [99, 98], proposal_len=2)])
    assert rows(p) == [[13, 14], []] and p.width == 2
    assert p.scores[0] == pytest.approx(2.0) and p.scores[1] == 0.0 and not p.has_probs
    p.validate()


def test_the_global_tree_keeps_outputs_after_the_prompt_tail_a_match_can_reach():
    sp = proposer(suffix_max_depth=4)
    sp.finished(seq(1, [1, 2, 3, 4, 5, 6, 7, 8], prompt_len=6))
    assert sp.cache.tokens(1) == [4, 5, 6, 7, 8]                   # the prompt's last 3, then the output
    assert rows(sp.propose(1, [seq(2, [9, 5, 6], proposal_len=2)]))[0] == [7, 8]
    assert rows(sp.propose(1, [seq(3, [9, 1, 2], proposal_len=2)]))[0] == []     # the prompt's head is not kept


def test_each_source_is_trusted_as_far_as_its_proposals_agreed_with_the_target():
    sp = proposer()
    sp.finished(seq(1, [1, 2, 3, 4, 5], prompt_len=1))
    s = seq(2, [7, 1, 2, 3, 8, 1, 2, 3], proposal_len=2)
    p = sp.propose(1, [s])                   # the global tree: 1 2 3 -> 4 5, chances 1; its own: 8 at 1/2
    assert rows(p)[0] == [4, 5] and p.scores[0] == pytest.approx(2.0)
    for _ in range(30):
        # The target goes on as the request itself did before: the global tree's proposal
        # is wrong from its first token, the request's own right (verified or not).
        sp.propose(1, [s])
        sp.judge(2, (8, 1, 9))
    p = sp.propose(1, [s])
    assert rows(p)[0] == [8, 1] and sp.records["global"].calibration < 0.5
    assert sp.records["own"].calibration == pytest.approx(sp.ceiling()) and sp.ceiling() > 1.0
    before = dict(vars(sp.records["own"]))
    sp.judge(2, ())                        # nothing emitted: nothing learnt
    sp.judge(2, (8, 1, 9))                 # no proposal pending any more: nothing learnt
    assert vars(sp.records["own"]) == before


def test_a_proposal_is_judged_as_far_as_the_emitted_tokens_reach():
    """Tokens that disagree judge the whole proposal; tokens that all agree, fewer than it
    proposed, judge it as a proposal of their length (past them nothing is known)."""
    sp = proposer(suffix_max_depth=8)
    sp.finished(seq(1, [1, 2, 3, 4, 5, 6, 7, 8], prompt_len=1))
    sp.finished(seq(2, [1, 2, 3, 4, 5, 6, 9, 9], prompt_len=1))
    s = seq(3, [0, 1, 2, 3, 4], proposal_len=4)    # proposes 5 6 (chances 1), then 7 or 9 (1/2) and on
    ref = ScoreRecord()
    for emitted, stated, agreed in [((5, 0), [1, 1, .5, .5], 1),     # wrong at its second token
                                    ((5,), [1], 1),                   # right, as far as anyone knows
                                    ((5, 6, 7, 8, 1), [1, 1, .5, .5], 4),
                                    ((5, 6), [1, 1], 2)]:
        p = sp.propose(1, [s])
        assert rows(p)[0] == [5, 6, 7, 8] and p.scores == [pytest.approx(3.0 * sp.records["global"].calibration)]
        sp.judge(3, emitted)
        ref.observe(sum(stated), agreed)
        assert vars(sp.records["global"]) == pytest.approx(vars(ref))
    # A step that found no proposal leaves nothing to judge.
    sp.propose(1, [s])
    sp.propose(1, [seq(3, [0, 50, 51], proposal_len=4)])
    sp.judge(3, (5, 6))
    assert vars(sp.records["global"]) == pytest.approx(vars(ref))


def test_a_request_proposes_from_its_own_repeats_and_keeps_its_tree_as_it_grows():
    sp = proposer(suffix_cache_requests=0)
    s = seq(5, [1, 2, 3, 4, 9, 1, 2])
    assert rows(sp.propose(1, [s]))[0] == [3, 4]      # "1 2" was followed by "3 4 9"; a match of 2 proposes 2
    s.tokens += [3, 4, 9, 1, 2, 3]                     # the target emitted more: the tree grows by it
    assert rows(sp.propose(2, [s]))[0] == [4, 9, 1, 2]
    assert sp.requests[5].num_tokens == len(s.tokens)
    sp.finished(s)                                       # no global cache: it is simply dropped
    assert sp.stats()["suffix_cached_requests"] == 0 and 5 not in sp.requests


def test_the_global_tree_keeps_the_last_requests_first_in_first_out():
    sp = proposer(suffix_cache_requests=2)
    for i in range(4):
        sp.finished(seq(i, [50 + i, 60, 70 + i, 80]))
    assert list(sp._order) == [2, 3] and sp.stats()["suffix_cached_requests"] == 2
    sp.cache.check_integrity()
    assert rows(sp.propose(1, [seq(9, [50])]))[0] == []              # request 0 left the cache
    assert rows(sp.propose(1, [seq(9, [53])]))[0] == [60]            # request 3 is in it
    assert rows(sp.propose(1, [seq(9, [53, 60])]))[0] == [73, 80]


def test_the_node_budget_evicts_the_oldest_requests():
    sp = proposer(suffix_max_nodes=40, suffix_max_depth=4)
    for i in range(6):
        sp.finished(seq(i, list(range(100 * i, 100 * i + 10)), prompt_len=1))   # no shared paths: 34 nodes each
    st = sp.stats()
    assert sp.cache.num_nodes <= 40 and st["suffix_cached_requests"] == 1 and list(sp._order) == [5]
    assert st["suffix_tree_bytes"] > 0


def test_the_reported_bytes_are_what_the_trees_take():
    """suffix_tree_bytes against the memory Python allocated for the trees (tracemalloc)."""
    import random
    import tracemalloc

    rng = random.Random(0)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        sp = proposer(suffix_max_depth=16)
        for i in range(12):
            base = [rng.randrange(256) for _ in range(30)]
            sp.finished(seq(i, [rng.randrange(256) if j % 7 == 0 else t for j, t in enumerate(base * 4)],
                             prompt_len=1))
        taken = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert sp.cache.num_nodes > 10_000
    assert 0.7 < sp.stats()["suffix_tree_bytes"] / taken < 1.3


def test_proposals_never_pass_the_proposal_len_and_failed_requests_teach_nothing():
    sp = proposer()
    sp.finished(seq(1, list(range(20))))
    p = sp.propose(1, [seq(2, [0, 1, 2, 3, 4, 5, 6, 7], proposal_len=3), seq(3, [0, 1], proposal_len=1)])
    assert p.proposal_lens == [3, 1] and rows(p) == [[8, 9, 10], [2]]
    sp.forget([2, 3])
    assert not sp.requests


def test_bad_settings_are_refused_naming_the_field():
    for kw, name in ((dict(suffix_cache_requests=-1), "suffix_cache_requests"),
                     (dict(suffix_max_depth=1), "suffix_max_depth"),
                     (dict(suffix_min_prob=0.0), "suffix_min_prob"), (dict(suffix_min_prob=1.5), "suffix_min_prob"),
                     (dict(suffix_spec_factor=0), "suffix_spec_factor"),
                     (dict(suffix_max_nodes=0), "suffix_max_nodes")):
        with pytest.raises(ValueError, match=name):
            SpeculationConfig(proposer="suffix", **kw)
