"""The draft model as a proposer: one rank per draft worker, each reached through its
``WorkerCall`` (an actor over its link, or a worker in this process), so every rank
drafts at once and its probabilities stay a handle the target resolves.

Draft workers keep their own KV cache, which the driver's ``num_computed`` bookkeeping
covers (``Sequence.draft_computed``), so the verdicts teach the proposer nothing more.
Where its calls are ``PredraftCall``s (``predraft=True``) it pre-drafts the next window
while the target verifies (``specray.runtime.engine.predraft_book``).
"""

from __future__ import annotations

from typing import Any

from specray.runtime.transport.worker_call import WorkerCall
from specray.scheduler.messages import StepPlan
from specray.scheduler.proposers.proposer import Proposer, Shard
from specray.scheduler.sequence import Sequence


class DraftModelProposer(Proposer):
    def __init__(self, calls: list[WorkerCall], predraft: bool = False) -> None:
        """``calls[r]``: draft worker ``r``; ``predraft``: they are ``PredraftCall``s."""
        self.calls = calls
        self.num_ranks = len(calls)
        self.can_predraft = predraft

    def submit(self, rank: int, plan: StepPlan, seqs: list[Sequence]) -> Any:
        return self.calls[rank].submit(plan)

    def wait(self, rank: int, handle: Any) -> Shard:
        return self.calls[rank].wait(handle)

    def alive(self, rank: int) -> bool:
        return self.calls[rank].alive()

    def gone(self, rank: int) -> bool:
        return self.calls[rank].gone()

    def close(self) -> None:
        for call in self.calls:
            call.close()

    def submit_predraft(self, rank: int, step_id: int) -> Any:
        return self.calls[rank].submit_predraft(step_id)

    def submit_adopt(self, rank: int, plan: StepPlan, chosen: list[int]) -> Any:
        return self.calls[rank].submit_adopt(plan, chosen)

    def wait_predraft(self, rank: int, handle: Any):
        return self.calls[rank].wait_predraft(handle)
