"""Taking proposals from a pre-draft: a branch holds only for exactly the state it
assumed, a window is the branch's proposals cut to the plan, and the pre-draft message
survives the wire."""

from __future__ import annotations

import math

import pytest

from specray.scheduler.merge import merge_proposals
from specray.scheduler.messages import Predraft, ProtocolError, StepPlan, decode, encode
from specray.scheduler.predraft import all_held, branches, window


def match(plan: StepPlan, pre: Predraft) -> list[int] | None:
    return all_held(branches(plan, pre))


def plan_for(seq_ids, num_computed, fed, proposal_lens, k=3, **kw) -> StepPlan:
    n = len(seq_ids)
    return StepPlan(step_id=2, width=k, seq_ids=list(seq_ids), num_computed=list(num_computed),
                    num_new=[len(f) for f in fed], token_ids=[t for f in fed for t in f],
                    num_slots=[c + len(f) + k for c, f in zip(num_computed, fed)], proposal_lens=list(proposal_lens),
                    temperature=[0.0] * n, top_k=[0] * n, top_p=[1.0] * n, seeds=[0] * n, **kw)


def predraft() -> Predraft:
    # Sequence 7 proposed [5, 6] at 10: rejected at 0 (guess 9 or 8), at 1 (guess 4), or
    # all accepted (the draft caught up on 6, bonus guess 2). Sequence 8: one branch.
    return Predraft(step_id=1, width=3, seq_ids=[7, 7, 7, 7, 8], num_computed=[10, 10, 11, 11, 20],
                    fed_lens=[1, 1, 1, 2, 1], fed_token_ids=[9, 8, 4, 6, 2, 1],
                    proposal_lens=[3, 3, 3, 3, 2], token_ids=[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, -1])


def test_a_branch_holds_only_for_the_exact_state_it_assumed():
    pre = predraft()
    assert match(plan_for([7], [10], [[8]], [3]), pre) == [1]
    assert match(plan_for([7], [11], [[6, 2]], [3]), pre) == [3]
    assert match(plan_for([7, 8], [11, 20], [[4], [1]], [2, 2]), pre) == [2, 4]
    # Another guess, another base, a longer window than drafted, a sequence without any:
    assert match(plan_for([7], [10], [[3]], [3]), pre) is None
    assert match(plan_for([7], [9], [[9]], [3]), pre) is None
    assert match(plan_for([8], [20], [[1]], [3]), pre) is None
    assert match(plan_for([7, 9], [10, 0], [[9], [1, 2]], [1, 1]), pre) is None
    assert match(plan_for([], [], [], []), pre) is None


def test_branches_names_each_sequences_branch_where_match_takes_all_or_none():
    pre = predraft()
    plan = plan_for([7, 8, 9], [10, 20, 0], [[8], [1], [1, 2]], [3, 2, 1])
    assert branches(plan, pre) == [1, 4, None]
    assert match(plan, pre) is None
    assert branches(plan_for([], [], [], []), pre) == []


def test_a_window_is_the_branch_cut_to_the_plan():
    pre = predraft()
    plan = plan_for([7, 8], [10, 20], [[9], [1]], [2, 2])
    got = window(plan, pre, [0, 4])
    assert got.proposal_lens == [2, 2] and got.token_ids == [1, 2, -1, 13, 14, -1]
    assert not got.has_probs


def test_a_window_points_its_probabilities_at_the_branch_rows():
    pre = predraft()
    pre.has_probs = True
    shard = window(plan_for([8, 7], [20, 11], [[1], [4]], [1, 3]), pre, [4, 2])
    assert shard.prob_rows == [4, 2] and shard.num_prob_rows == 5
    # Merged beside a shard of 2 rows that came first, rows index the concatenation.
    from specray.scheduler.messages import Proposals

    other = Proposals(step_id=2, width=3, has_probs=True, seq_ids=[1, 2], proposal_lens=[1, 1],
                      token_ids=[5, -1, -1, 6, -1, -1])
    merged = merge_proposals(plan_for([7, 1, 8], [11, 0, 20], [[4], [1], [1]], [3, 1, 1]), [other, shard])
    assert merged.draft_rows == [2 + 2, 0, 2 + 4]


def test_the_predraft_message_round_trips_and_refuses_what_does_not_add_up():
    pre = predraft()
    assert decode(encode(pre), expected=Predraft) == pre
    bad = predraft()
    bad.fed_lens = [1, 1, 1, 1, 1]
    with pytest.raises(ProtocolError, match="fed_token_ids"):
        decode(encode(bad), expected=Predraft)
    bad = predraft()
    bad.proposal_lens[0] = 4
    with pytest.raises(ProtocolError, match="proposal_lens"):
        decode(encode(bad), expected=Predraft)
    assert math.isfinite(pre.compute_s)
