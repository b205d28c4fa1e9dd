"""A proposer that runs in the target worker's process (an EAGLE head: it reads the
target's own hidden states), seen from the driver.

Its proposals cannot be made anywhere else, and a hop to fetch them would cost what they
save. So the driver only asks: ``submit`` hands back, for each drafting sequence, its
``proposal_len`` with -1 tokens and the row marker ``IN_TARGET_ROW``; the merge carries
them into the target plan (``StepPlan.draft_rows``), and the target worker makes the
proposals inside its verify call, before its forward, from what its previous verify kept
(``specray.workers.in_target_head``). A step stays one call to the target.

A head may propose fewer tokens than asked (none for a sequence it holds nothing for yet:
its first step, or after a preemption): the verdict's ``proposed`` says how many were
verified. With suffix decoding beside it (``MergedProposer``) the per-sequence choice is
made on the driver before the head runs: the choice reads only the head's acceptance
record and the suffix's scores, never the head's tokens.
"""

from __future__ import annotations

from specray.scheduler.messages import IN_TARGET_ROW, Proposals, StepPlan
from specray.scheduler.proposers.proposer import HostProposer
from specray.scheduler.sequence import Sequence


class InTargetProposer(HostProposer):
    def propose_plan(self, plan: StepPlan, seqs: list[Sequence]) -> Proposals:
        n = plan.num_seqs
        return Proposals(step_id=plan.step_id, width=plan.width, seq_ids=list(plan.seq_ids),
                         proposal_lens=list(plan.proposal_lens), token_ids=[-1] * (n * plan.width),
                         prob_rows=[IN_TARGET_ROW] * n)
