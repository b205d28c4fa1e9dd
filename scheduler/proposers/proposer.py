"""The one contract every proposer keeps (``Proposer``): the engine asks it for a step's
proposals and tells it the verdicts, and never asks which one it has.

A proposer lives where its inputs are:

- the draft model on workers of its own, actors reached over their link or in the
  driver's process (``specray.runtime.transport.draft_proposer.DraftModelProposer``);
- n-gram lookup and suffix decoding in the driver's process, beside the scheduler
  (``HostProposer``: ``ngram``, ``suffix``);
- a head that reads the target's hidden states (EAGLE) in the target worker's process:
  its proposals are made inside the target's verify call (``in_target.InTargetProposer``
  asks, ``specray.workers.in_target_head`` is the target's side);
- two of them merged per sequence (``merged.MergedProposer``), itself a proposer.

Ranks. A proposer that runs on several workers has one rank per worker, and the scheduler
plans one draft plan per rank (``ScheduledStep.draft_plans``): each rank proposes for
its own sequences, may be lost on its own (``WorkerLost``, which the scheduler deals
with per rank) and comes back on its own. A proposer in one process has one rank.

One step, as the engine drives it::

    h = proposer.submit(rank, plan, seqs)     # every rank's first: they compute at once
    proposals, probs = proposer.wait(rank, h) # per rank; raises WorkerLost if it died
    ... the target verifies ...
    proposer.observe(outcome)                 # the step's verdicts, before the scheduler
    proposer.finished(seq)                    # per request that ended with its output

``submit`` must not wait for remote work: the engine sends every rank's call (and
then every target's) before it waits for any, and with two groups in flight a rank's
call stays out while the target verifies the other group.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from specray.scheduler.messages import Predraft, Proposals, StepPlan
    from specray.scheduler.sequence import Sequence
    from specray.scheduler.step import StepOutcome

# One rank's answer: its proposals and the handle of their probabilities (None where the
# proposals are deterministic: the sampler treats them as one-hot). The handle is what
# the target resolves: a tensor in process, a Ray reference from an actor; the engine
# hands it on unread.
Shard = tuple["Proposals", Any]


class Proposer(ABC):
    """What every proposer does: ``submit`` and ``wait`` are its own; the other methods'
    bodies are what a proposer that needs nothing more does."""

    # Draft plans a step has for it: one per worker it runs on (the scheduler's draft ranks).
    num_ranks: int = 1
    # Whether it can pre-draft the next window while the target verifies
    # (``submit_predraft``, ``submit_adopt``, ``wait_predraft``): the draft model's workers.
    can_predraft: bool = False

    @abstractmethod
    def submit(self, rank: int, plan: StepPlan, seqs: list[Sequence]) -> Any:
        """Start rank ``rank``'s proposals for its draft ``plan`` (``seqs``: the plan's
        sequences, in its order): each sequence up to its ``proposal_lens`` entry, in a
        ``[n, plan.width]`` grid. Returns a handle for ``wait``. The plan also carries
        the frees of sequences the rank held; a plan may carry only frees."""

    @abstractmethod
    def wait(self, rank: int, handle: Any) -> Shard:
        """The proposals ``submit`` started. Raises ``WorkerLost`` when the rank's worker
        died; its sequences then verify without proposals this step."""

    def observe(self, outcome: StepOutcome) -> None:  # noqa: B027 - optional: most proposers need not hear it
        """A step's verdicts (``outcome.verdicts``), before the scheduler applies them: a
        proposer that weighs its proposals learns here, and one whose cache holds
        proposals another proposer's verdict overruled says how many still hold
        (``outcome.draft_kept``)."""

    def finished(self, seq: Sequence) -> None:  # noqa: B027 - optional: most proposers need not hear it
        """A request ended with its output (after the step that finished it, or between
        steps where the driver ended it on a stop string)."""

    def forget(self, seq_ids: list[int]) -> None:  # noqa: B027 - optional: most proposers need not hear it
        """Requests that ended without an output worth learning from (failed, aborted)."""

    def alive(self, rank: int) -> bool:
        """Whether a rank lost earlier answers again (cheap, non-blocking)."""
        return True

    def gone(self, rank: int) -> bool:
        """Whether a rank will never come back (its worker restarted too often)."""
        return False

    def close(self) -> None:  # noqa: B027 - optional: most proposers need not hear it
        """Let go of its workers' connections (the pool kills the actors)."""

    def stats(self) -> dict:
        """Its own figures for ``metrics()``."""
        return {}

    # -- pre-drafting (``can_predraft``): while the target verifies the window just sent
    def submit_predraft(self, rank: int, step_id: int) -> Any:
        raise NotImplementedError(f"{type(self).__name__} does not pre-draft")

    def submit_adopt(self, rank: int, plan: StepPlan, chosen: list[int]) -> Any:
        raise NotImplementedError(f"{type(self).__name__} does not pre-draft")

    def wait_predraft(self, rank: int, handle: Any) -> tuple[Predraft, Any]:
        raise NotImplementedError(f"{type(self).__name__} does not pre-draft")


class HostProposer(Proposer):
    """A proposer in the driver's process: one rank, computed in ``submit`` (no hop), so
    ``wait`` hands back what ``submit`` made. Subclasses define ``propose_plan``."""

    def submit(self, rank: int, plan: StepPlan, seqs: list[Sequence]) -> Shard:
        return self.propose_plan(plan, seqs), None

    def wait(self, rank: int, handle: Shard) -> Shard:
        return handle

    @abstractmethod
    def propose_plan(self, plan: StepPlan, seqs: list[Sequence]) -> Proposals:
        """The plan's proposals, computed now."""


class NoProposer(Proposer):
    """``proposer="none"``: no ranks, so the scheduler plans no draft plans and nothing
    is ever asked of it."""

    num_ranks = 0

    def submit(self, rank: int, plan: StepPlan, seqs: list[Sequence]) -> Any:
        raise ValueError(f"proposer 'none' has no rank {rank}: it proposes nothing")

    def wait(self, rank: int, handle: Any) -> Shard:
        raise ValueError(f"proposer 'none' has no rank {rank}: it proposes nothing")
