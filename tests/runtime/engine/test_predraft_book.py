"""The engine's book of pre-drafts: a draft plan is served from a pre-draft only when
every sequence's branch holds, the windows it drops are counted, and whether to pre-draft
follows the share of branches that held (with a drift back that keeps probing)."""

from __future__ import annotations

from specray.runtime.engine.predraft_book import PredraftBook
from specray.scheduler.messages import Predraft, StepPlan


def plan_for(seq_ids, num_computed, fed, k=2) -> StepPlan:
    n = len(seq_ids)
    return StepPlan(step_id=5, width=k, seq_ids=list(seq_ids), num_computed=list(num_computed),
                    num_new=[len(f) for f in fed], token_ids=[t for f in fed for t in f],
                    num_slots=[c + len(f) + 2 * k for c, f in zip(num_computed, fed)], proposal_lens=[k] * n,
                    temperature=[0.0] * n, top_k=[0] * n, top_p=[1.0] * n, seeds=[0] * n)


def pre() -> Predraft:
    # Sequence 1 at base 10 guessed [4, 7]; sequence 2 at base 20 guessed [5, 8].
    return Predraft(step_id=4, width=2, seq_ids=[1, 2], num_computed=[10, 20], fed_lens=[2, 2],
                    fed_token_ids=[4, 7, 5, 8],
                    proposal_lens=[2, 2], token_ids=[30, 31, 40, 41])


def test_a_plan_is_served_only_when_every_branch_holds():
    book = PredraftBook()
    book.pending[0] = (pre(), "probs")
    got, dropped = book.take(0, plan_for([1, 2], [10, 20], [[4, 7], [5, 8]]))
    assert dropped == 0 and got.chosen == [0, 1] and got.probs == "probs"
    assert got.proposals.token_ids == [30, 31, 40, 41] and got.proposals.prob_rows == []
    # The target emitted another bonus for sequence 2: nothing is taken, both windows drop.
    book.pending[0] = (pre(), None)
    got, dropped = book.take(0, plan_for([1, 2], [10, 20], [[4, 7], [5, 9]]))
    assert got is None and dropped == 2
    # A plan of sequence 1 alone takes its window and drops sequence 2's.
    book.pending[0] = (pre(), None)
    got, dropped = book.take(0, plan_for([1], [10], [[4, 7]]))
    assert got.chosen == [0] and dropped == 1
    assert book.take(1, plan_for([1], [10], [[4, 7]])) == (None, 0)     # no pre-draft for rank 1


def test_pre_drafting_follows_the_share_of_branches_that_held_and_probes_again():
    book = PredraftBook()
    one, eight = plan_for([1], [10], [[4]]), plan_for(list(range(8)), [0] * 8, [[1]] * 8)
    assert book.wanted(one) and not book.wanted(eight)       # 0.7 alone; 0.7 ** 8 for all eight
    for _ in range(40):                                      # sequence 1's branch keeps missing
        book.pending[0] = (pre(), None)
        book.take(0, plan_for([1], [10], [[4, 6]]))
    assert not book.wanted(one)
    for _ in range(200):
        if book.wanted(one):
            break
    assert book.wanted(one)                                  # drifted back to its prior: probes again


def test_a_pre_draft_with_probabilities_of_another_width_is_not_served():
    """Its probabilities are [B, 2, V]: a step of width 1 verifies [n, 1, V] (seen when
    chunked prefill and a shrinking proposal limit change a step's width)."""
    book = PredraftBook()
    sampled = pre()
    sampled.has_probs = True
    book.pending[0] = (sampled, "probs")
    got, dropped = book.take(0, plan_for([1, 2], [10, 20], [[4, 7], [5, 8]], k=1))
    assert got is None and dropped == 2
    book.pending[0] = (pre(), None)                    # greedy: no probabilities, served in any width
    got, _ = book.take(0, plan_for([1, 2], [10, 20], [[4, 7], [5, 8]], k=1))
    assert got is not None and got.proposals.token_ids == [30, 40]
