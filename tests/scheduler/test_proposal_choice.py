"""Which of several proposals of a sequence is verified, and how the draft's record and
cache follow that choice."""

from __future__ import annotations

import pytest

from specray.scheduler.merge import merge_proposals
from specray.scheduler.messages import Proposals, StepPlan
from specray.scheduler.proposal_choice import DraftRecord, ScoreRecord, common_prefix, pick_shards


def shard(width, rows: dict[int, list[int]], scores=None, has_probs=False) -> Proposals:
    toks = [t for r in rows.values() for t in r + [-1] * (width - len(r))]
    return Proposals(step_id=1, width=width, has_probs=has_probs, seq_ids=list(rows),
                     proposal_lens=[len(r) for r in rows.values()], token_ids=toks, scores=scores or [])


def test_the_draft_record_values_proposals_by_its_acceptance():
    r = DraftRecord()
    assert r.rate == pytest.approx(0.6)
    assert r.expected(3) == pytest.approx(0.6 + 0.36 + 0.216)
    for _ in range(200):
        r.observe(4, 4)
    assert r.rate > 0.95 and r.expected(4) > 3.5
    r.observe(0, 0)                                   # nothing proposed: nothing learnt
    assert r.rate > 0.95


def test_each_sequence_takes_the_proposal_expected_to_be_accepted_longer():
    draft = shard(3, {1: [5, 6, 7], 2: [5, 6, 7], 3: [5]}, has_probs=True)
    suffix = shard(3, {1: [8, 9], 2: [8], 3: [], 4: [8]}, scores=[1.9, 0.5, 0.0, 0.7])
    record = DraftRecord(prior=0.5, prior_weight=1.0)   # three draft proposals: 0.875 expected
    picks = pick_shards([1, 2, 3, 4], [draft, suffix], record)
    assert picks == {1: 1, 2: 0, 3: 0, 4: 1}
    n = 4
    plan = StepPlan(step_id=1, width=3, seq_ids=[1, 2, 3, 4], num_computed=[0] * n, num_new=[1] * n,
                    token_ids=[0] * n, num_slots=[4] * n, proposal_lens=[3, 3, 1, 1], temperature=[1.0] * n,
                    top_k=[0] * n, top_p=[1.0] * n, seeds=[0] * n)
    merged = merge_proposals(plan, [draft, suffix], picks)
    assert merged.proposal_lens == [2, 3, 1, 1]
    assert merged.proposal_token_ids == [8, 9, -1, 5, 6, 7, 5, -1, -1, 8, -1, -1]
    # Suffix proposals are one-hot (no rows); the draft's keep their rows.
    assert merged.draft_rows == [-1, 1, 2, -1]


def test_ties_go_to_the_draft_and_an_empty_proposal_never_wins():
    draft = shard(2, {1: [5, 6]})
    record = DraftRecord(prior=0.5, prior_weight=1.0)   # 0.75
    assert pick_shards([1], [draft, shard(2, {1: [8]}, scores=[0.75])], record) == {1: 0}
    assert pick_shards([1], [shard(2, {1: []}), shard(2, {1: [8]}, scores=[0.01])], record) == {1: 1}


def test_the_score_record_calibrates_and_its_evidence_fades():
    r = ScoreRecord()
    assert r.calibration == 1.0
    for _ in range(20):
        r.observe(2.0, 0)                               # stated two tokens, none accepted
    low = r.calibration
    assert low < 0.2
    for _ in range(500):
        r.fade()                                        # steps it sat out: the evidence ages
    assert r.calibration > 0.9
    for _ in range(300):
        r.observe(1.0, 2)                               # more held than it stated
    assert r.calibration > 1.9


def test_common_prefix():
    assert common_prefix([1, 2, 3], (1, 2, 4, 5)) == 2
    assert common_prefix([], (1,)) == 0 and common_prefix([1, 2], (1, 2)) == 2


@pytest.mark.parametrize("ranks", [1, 2])
def test_draft_and_suffix_side_by_side_keep_outputs_and_the_drafts_cache_exact(ranks):
    """The real Engine with fake workers and a fake suffix proposer beside the drafts: each
    sequence verifies one of the two proposals, the outputs stay plain greedy decoding's,
    and the fake draft workers' num_computed checks pass: after a step that verified the
    suffix's proposal, only the draft's cached proposals that match what was emitted count."""
    from engine_harness import MIXED, add_requests, assert_matches_reference, build

    eng = build(k=4, target_ranks=ranks, draft_ranks=ranks, max_model_len=64, target_blocks=40,
                suffix_wrong=lambda sid, pos: (sid + 2 * pos) % 5 == 0)
    verified = {"draft": 0, "suffix": 0, "either": 0}
    verify = eng.verify

    def count(r, plan, probs):
        for i, sid in enumerate(plan.seq_ids):
            got = plan.proposal_token_ids[i * plan.width:i * plan.width + plan.proposal_lens[i]] \
                if plan.proposal_token_ids else []
            if got and got == eng._suffix_proposed.get(sid) == eng._proposed.get(sid):
                verified["either"] += 1
            elif got and got == eng._suffix_proposed.get(sid):
                verified["suffix"] += 1
            elif got:
                verified["draft"] += 1
        return verify(r, plan, probs)
    eng.verify = count
    ref = add_requests(eng, MIXED)
    eng.run()
    assert_matches_reference(eng, ref)
    assert verified["draft"] > 20 and verified["suffix"] > 20
    assert sorted(eng.suffix.finished_ids) == sorted(ref)
    assert eng.engine.proposer.record.accepted > 0
    # The suffix proposer hears what every verified sequence emitted, whichever proposal
    # was verified: it judges its own proposals against them.
    assert len(eng.suffix.observed) >= sum(verified.values())
    emitted = {}
    for sid, tokens in eng.suffix.observed:
        emitted[sid] = emitted.get(sid, ()) + tokens
    assert all(list(emitted[sid]) == out for sid, (out, _) in ref.items())
