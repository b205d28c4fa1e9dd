"""How the ranks of a tensor-parallel worker take a step together.

Rank 0 is the worker the driver reaches (in the driver's process, over a link or a Ray
call, as any worker): its calls are the driver's. Before a step's forward it broadcasts
the step to its group (``StepShare.send``: an op byte and the call's msgpack bytes, one
torch.distributed broadcast); each other rank waits in ``follow`` and runs the same call
with it, its own part of the model over its own part of the KV cache. The other ranks
answer nothing. No Ray call reaches a rank past 0 per step.

- A target's ranks past 0 run the forward of ``verify`` only (``TargetWorker.score``):
  rank 0's collectives give it the whole logits, and it alone samples. Rank 0 checks a
  plan wholly before it shares it, so a plan it refuses reaches no other rank.
- A draft's ranks run its whole calls (``propose``, ``predraft``, ``adopt``): each pass's
  tokens feed the next, and every rank draws the same ones, from the same gathered logits
  and the same keyed uniforms.

A call refused in its first part (the plan's checks and the KV cache's, the same on every
rank, before any collective) is refused by every rank alike, and the group stays in step.
Anything else that fails on a rank (a peer gone: its collectives fail or time out,
``RankGroup``) ends ``follow`` with the error: the group is broken and is formed again.
"""

from __future__ import annotations

import logging

import msgpack

from specray.scheduler.messages import StepPlan, decode, encode
from specray.workers.errors import PlanError, StaleCacheError
from specray.workers.tensor_parallel import RankGroup

log = logging.getLogger(__name__)

OP_STOP = 0
OP_VERIFY = 1       # a target's verify: the plan
OP_PROPOSE = 2      # a draft's propose: the plan
OP_PREDRAFT = 3     # a draft's predraft: [step_id]
OP_ADOPT = 4        # a draft's adopt: [plan, chosen]


class StepShare:
    """Rank 0's side: each step's plan to the other ranks of ``group``."""

    def __init__(self, group: RankGroup) -> None:
        if group.rank != 0:
            raise ValueError(f"rank {group.rank} follows; rank 0 shares the steps")
        self.group = group
        self.steps = 0

    def send(self, op: int, plan: StepPlan | None = None, arg=None) -> None:
        """``plan`` and ``arg`` (msgpack types) as the op takes them."""
        if op in (OP_VERIFY, OP_PROPOSE):
            body = encode(plan)
        else:
            body = msgpack.packb([arg] if plan is None else [encode(plan), arg], use_bin_type=True)
        self.group.broadcast(bytes([op]) + body)
        self.steps += 1

    def stop(self) -> None:
        """The other ranks leave ``follow`` (rank 0 is done with the group)."""
        self.group.broadcast(bytes([OP_STOP]))


def follow(worker, group: RankGroup) -> int:
    """A rank past 0: run the steps rank 0 shares with ``worker`` (a ``TargetWorker`` or
    ``DraftWorker`` built on ``group``) until it says stop; returns the steps run. Raises
    where the group breaks."""
    if group.rank == 0:
        raise ValueError("rank 0 takes the driver's calls; only the other ranks follow")
    steps = 0
    while True:
        msg = group.broadcast()
        op, body = msg[0], msg[1:]
        if op == OP_STOP:
            return steps
        try:
            _run(worker, op, body)
        except (PlanError, StaleCacheError) as e:
            # Rank 0 met the same refusal before any collective: the group is still in step.
            log.info("rank %d: a step refused as on rank 0 (%s)", group.rank, e)
        steps += 1


def _run(worker, op: int, body: bytes) -> None:
    if op == OP_VERIFY:
        worker.score(decode(body, StepPlan, validate=False))
    elif op == OP_PROPOSE:
        worker.propose(decode(body, StepPlan, validate=False))
    elif op == OP_PREDRAFT:
        (step_id,) = msgpack.unpackb(body, raw=False)
        worker.predraft(step_id)
    elif op == OP_ADOPT:
        plan, chosen = msgpack.unpackb(body, raw=False)
        worker.adopt(decode(plan, StepPlan, validate=False), chosen)
    else:
        raise ValueError(f"unknown step op {op}")
