"""Taking a step's proposals from a pre-draft: which branch holds for each sequence, and
the window it gives.

While the target verifies window t, a draft worker drafts window t+1 from the few most
likely outcomes of that verification (``Predraft``: one branch per outcome). Once the
verdict is in and the next step is planned, a sequence's branch holds when the draft
plan's ``num_computed`` and fed tokens are exactly the ones the branch assumed: its
proposals were then drafted on the prefix the target actually emitted, so taking them is
the same as drafting them now (exactness needs nothing more). A step takes pre-drafted
proposals only when every drafting sequence of a draft worker has a branch that holds;
otherwise that worker drafts as it would without pre-drafts.
"""

from __future__ import annotations

from specray.scheduler.messages import Predraft, Proposals, StepPlan


def branches(plan: StepPlan, pre: Predraft) -> list[int | None]:
    """For each sequence of the draft ``plan``, the branch of ``pre`` that holds, or None."""
    offsets, pos = [], 0
    for n in pre.fed_lens:
        offsets.append(pos)
        pos += n
    by_key: dict[tuple, int] = {}
    for b, sid in enumerate(pre.seq_ids):
        fed = tuple(pre.fed_token_ids[offsets[b]:offsets[b] + pre.fed_lens[b]])
        by_key.setdefault((sid, pre.num_computed[b], fed), b)
    out: list[int | None] = []
    pos = 0
    for i, sid in enumerate(plan.seq_ids):
        fed = tuple(plan.token_ids[pos:pos + plan.num_new[i]])
        pos += plan.num_new[i]
        b = by_key.get((sid, plan.num_computed[i], fed))
        out.append(b if b is not None and pre.proposal_lens[b] >= plan.proposal_lens[i] else None)
    return out


def all_held(held: list[int | None]) -> list[int] | None:
    """``held`` (from ``branches``) when every sequence has a branch, else None: a plan
    takes its whole window from the pre-draft or none of it."""
    if not held or any(b is None for b in held):
        return None
    return held


def window(plan: StepPlan, pre: Predraft, chosen: list[int]) -> Proposals:
    """The proposals the draft plan gets from its chosen branches: each sequence's first
    ``proposal_lens[i]``, in the plan's width, with its probabilities' rows pointing into
    the pre-draft's."""
    width, m = plan.width, pre.width
    lens, tokens = [], []
    for i, b in enumerate(chosen):
        n = plan.proposal_lens[i]
        lens.append(n)
        tokens += pre.token_ids[b * m:b * m + n] + [-1] * (width - n)
    return Proposals(step_id=plan.step_id, width=width, has_probs=pre.has_probs, seq_ids=list(plan.seq_ids),
                     proposal_lens=lens, token_ids=tokens, prob_rows=list(chosen) if pre.has_probs else [],
                     num_prob_rows=pre.num_branches if pre.has_probs else 0)
