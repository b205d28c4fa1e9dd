"""A proposer inside the target worker's process (``InTargetHead``: an EAGLE head reads the
target's hidden states), and the one place the target worker calls it
(``propose_in_target``).

The seam, per step, inside ``TargetWorker.verify``::

    plan.draft_rows[i] == IN_TARGET_ROW      the driver asked this sequence's proposals of the head
      -> propose_in_target(head, plan, draft_probs)
           head.propose(plan, rows)          before the forward: token ids per row (host ints),
                                             probabilities [len(rows), width, V] or None
           -> the plan with those proposals and their draft rows, the probabilities appended
    ... the target's packed forward over fed tokens and proposals, the rejection sampler ...
    head.verified(plan, result)              after it: what the head keeps for the next step

What the head reads and keeps is its own: the target's hidden states of this step's
forward (captured by its own hook on the model: the residual stream at its aux layers,
for the packed rows in plan order), of which ``verified`` keeps the rows each sequence
accepted; its own KV. ``plan.free_seq_ids`` (in both calls) names sequences it must drop.
So a step stays one call to the target, with no hop for the proposals.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import replace

import torch

from specray.scheduler.messages import IN_TARGET_ROW, StepPlan, StepResult
from specray.workers.errors import PlanError


class InTargetHead(ABC):
    @abstractmethod
    def propose(self, plan: StepPlan, rows: list[int]) -> tuple[list[list[int]], torch.Tensor | None]:
        """Proposals for the plan's sequences ``rows`` (indices into the plan), before the
        target's forward of this step: for ``rows[a]`` at most ``plan.proposal_lens[rows[a]]``
        token ids of the target's vocabulary (host ints: the verify batch is laid out on
        the host; fewer, even none, where it holds nothing for the sequence yet), and,
        where the plan samples (``plan.temperature``), their probabilities
        ``[len(rows), plan.width, V]`` (V the target's vocabulary; 0 for what the head
        cannot propose) under each sequence's temperature, top_k and top_p, as the
        target's are (``specray.workers.sampling.logits_to_probs``); None when every
        sequence is greedy. The fed tokens (``plan.token_ids``) end with the token the
        last verify emitted."""

    def capture(self):
        """What the target's forward of this step should fill for ``verified`` (a
        ``llama_model.AuxCapture`` of the layers the head reads), or None: nothing."""
        return None

    @abstractmethod
    def verified(self, plan: StepPlan, result: StepResult) -> None:
        """The step's verification: sequence i kept ``result.num_emitted[i] - 1`` of its
        ``result.proposed[i]`` proposals. Keep what the next ``propose`` needs (the
        target's hidden states at the accepted rows) and nothing a rejection undid."""


def propose_in_target(head: InTargetHead | None, plan: StepPlan,
                      draft_probs: tuple) -> tuple[StepPlan, tuple]:
    """``plan`` with the head's proposals where its draft rows ask for them, and the
    draft probabilities with the head's appended (their rows follow the shards'); the
    plan and the probabilities unchanged where none do."""
    if not plan.draft_rows or min(plan.draft_rows) > IN_TARGET_ROW:    # C speed: every step asks
        return plan, draft_probs
    rows = [i for i, r in enumerate(plan.draft_rows) if r == IN_TARGET_ROW]
    if head is None:
        raise PlanError(f"StepPlan.draft_rows asks the target to propose for sequence {plan.seq_ids[rows[0]]}, "
                        f"and this target worker runs no proposer")
    tokens, probs = head.propose(plan, rows)
    width = plan.width
    if len(tokens) != len(rows):
        raise PlanError(f"the target's proposer answered {len(tokens)} rows for {len(rows)} sequences")
    if probs is None and any(plan.temperature[i] > 0 for i in rows):
        raise PlanError("the target's proposer gave no probabilities for sequences that sample")
    offset = sum(p.shape[0] for p in draft_probs if p is not None)
    props, lens, draft_rows = list(plan.proposal_token_ids), list(plan.proposal_lens), list(plan.draft_rows)
    for a, i in enumerate(rows):
        n = len(tokens[a])
        if n > lens[i]:
            raise PlanError(f"the target's proposer made {n} proposals for sequence {plan.seq_ids[i]}, "
                            f"{lens[i]} were asked")
        props[i * width:(i + 1) * width] = list(tokens[a]) + [-1] * (width - n)
        lens[i] = n
        draft_rows[i] = offset + a if probs is not None else -1
    plan = replace(plan, proposal_token_ids=props, proposal_lens=lens, draft_rows=draft_rows)
    return plan, (*draft_probs, probs) if probs is not None else draft_probs
