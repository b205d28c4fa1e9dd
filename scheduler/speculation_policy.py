"""How many tokens each sequence proposes: the interface between the scheduler and a
speculation policy, and the default policy, static k.

A policy is two calls::

    decide(PolicyView) -> Decision     before a step is planned
    observe(StepOutcome) -> None       once its verdicts are in

The scheduler reads nothing else of a policy. ``decide`` gets each running sequence's
``proposal_limit`` (the most its limits allow: ``max_tokens``, both models' windows,
``num_speculative_tokens``, a draft worker that is down) and returns each one's
``proposal_len`` (at most its limit) and the ``proposal_len`` of sequences admitted in
this step. ``observe`` gets the step's outcome: the same verdicts the scheduler and the
stats read. A policy may keep state between the two, per sequence only for the sequences
of its last view (a finished or preempted sequence is simply absent from the next one);
every ``decide`` is followed by one ``observe`` of the same step, or none when the step
failed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from specray.scheduler.config import SpeculationConfig

if TYPE_CHECKING:
    from specray.scheduler.step import StepOutcome


@dataclass
class PolicyView:
    seq_ids: list[int]            # running sequences, oldest first
    proposal_limits: list[int]    # the most each may propose this step
    fed_tokens: int = 0           # tokens the running batch feeds the target besides proposals
    batch_size: int = 0           # the batch this step may reach once waiting requests join


@dataclass
class Decision:
    proposal_lens: list[int]      # per running sequence, at most its proposal_limit
    newcomer_proposal_len: int = 0    # each sequence admitted this step (at most its own limit)


class SpeculationPolicy(Protocol):
    def decide(self, view: PolicyView) -> Decision: ...
    def observe(self, outcome: StepOutcome) -> None: ...


@dataclass
class StaticPolicy:
    """Every sequence proposes ``num_speculative_tokens`` wherever its limits allow;
    nobody proposes once the batch reaches ``disable_by_batch_size``."""

    speculation: SpeculationConfig

    def decide(self, view: PolicyView) -> Decision:
        k = self.speculation.num_speculative_tokens
        off = self.speculation.disable_by_batch_size
        lens = [0] * len(view.seq_ids) if off is not None and len(view.seq_ids) >= off else \
            [min(limit, k) for limit in view.proposal_limits]
        # Newcomers count the batch they join: requests arriving together into an empty
        # batch would otherwise all propose, and the draft prefill every prompt, in the
        # very step the limit exists to spare.
        return Decision(lens, newcomer_proposal_len=0 if off is not None and view.batch_size >= off else k)

    def observe(self, outcome: StepOutcome) -> None:
        pass
