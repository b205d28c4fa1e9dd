"""How the ranks of a tensor-parallel worker take a step together.

Rank 0 is the worker the driver reaches (in the driver's process, over a link or a Ray
call, as any worker): its calls are the driver's. Before a step's forward it broadcasts
the step to its group (``StepShare.send``: an op byte and the plan's msgpack bytes, one
torch.distributed broadcast); each other rank waits in ``follow`` and runs the same
forward with it, its own part of the model over its own part of the KV cache. The other
ranks answer nothing: rank 0's collectives give it the whole logits, and it alone samples.
No Ray call reaches a rank past 0 per step.

Rank 0 checks a plan wholly before it shares it, so a plan it refuses reaches no other
rank. A plan that the KV cache refuses (the same check on every rank, before any
collective) is refused by every rank alike, and the group stays in step. Anything else
that fails on a rank (a peer gone: its collectives fail or time out, ``RankGroup``) ends
``follow`` with the error: the group is broken and is formed again.
"""

from __future__ import annotations

import logging

from specray.scheduler.messages import StepPlan, decode, encode
from specray.workers.errors import PlanError, StaleCacheError
from specray.workers.tensor_parallel import RankGroup

log = logging.getLogger(__name__)

OP_STOP = 0
OP_VERIFY = 1


class StepShare:
    """Rank 0's side: each step's plan to the other ranks of ``group``."""

    def __init__(self, group: RankGroup) -> None:
        if group.rank != 0:
            raise ValueError(f"rank {group.rank} follows; rank 0 shares the steps")
        self.group = group
        self.steps = 0

    def send(self, op: int, plan: StepPlan) -> None:
        self.group.broadcast(bytes([op]) + encode(plan))
        self.steps += 1

    def stop(self) -> None:
        """The other ranks leave ``follow`` (rank 0 is done with the group)."""
        self.group.broadcast(bytes([OP_STOP]))


def follow(worker, group: RankGroup) -> int:
    """A rank past 0: run the steps rank 0 shares with ``worker`` (a ``TargetWorker``
    built on ``group``) until it says stop; returns the steps run. Raises where the group
    breaks."""
    if group.rank == 0:
        raise ValueError("rank 0 takes the driver's calls; only the other ranks follow")
    steps = 0
    while True:
        msg = group.broadcast()
        op = msg[0]
        if op == OP_STOP:
            return steps
        if op != OP_VERIFY:
            raise ValueError(f"rank {group.rank}: unknown step op {op}")
        plan = decode(msg[1:], StepPlan, validate=False)
        try:
            worker.score(plan)
        except (PlanError, StaleCacheError) as e:
            # Rank 0 met the same refusal before any collective: the group is still in step.
            log.info("rank %d: step %d refused as on rank 0 (%s)", group.rank, plan.step_id, e)
        steps += 1
