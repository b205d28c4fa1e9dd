"""The draft worker as a Ray actor (``DraftActor``), and the driver's handle on it
(``DraftHandle``): msgpack in, msgpack out.

Draft probabilities are a second return value, so the driver receives an ObjectRef it
hands to the target worker without fetching the tensor. With overlap the handle also
asks for pre-drafts (``PredraftCall``): an actor runs its calls one after another, in the
order submitted, so a pre-draft runs right after the window it drafts past. With a link
(``specray.runtime.transport.worker_link``) every call goes on the actor's own socket instead, in
the same order, and probabilities come back as tensors.

With ``draft_tensor_parallel_size`` > 1 the actor is rank 0 of a tensor-parallel draft and
starts the other ranks itself (``rank_groups.RankSet``). When its group breaks it ends its
own process: Ray restarts it as after any draft actor's death, with new ranks (its rank
actors and their placement are its own, and go with it).
"""

from __future__ import annotations

import logging
import os

import ray

from specray.runtime.transport.actor_handle import ActorHandle, WorkerActor
from specray.scheduler.config import CacheConfig
from specray.scheduler.messages import Predraft, Proposals, StepPlan, decode, encode
from specray.workers.config import ModelConfig

log = logging.getLogger(__name__)


class DraftActor(WorkerActor):
    def __init__(self, model: ModelConfig, cache: CacheConfig, tp_size: int = 1, rank_opts: dict | None = None,
                 tp_timeout_s: float = 60.0, placement_timeout_s: float = 300.0) -> None:
        """``tp_size`` > 1: rank 0 of a tensor-parallel draft whose other ranks ask Ray for
        ``rank_opts`` each."""
        # Imported in the actor, not here: the driver process names this class to start
        # the actor, and importing the workers (torch, transformers: seconds) there would
        # only delay the moment it starts loading.
        from specray.workers.draft_worker import DraftWorker

        super().__init__()
        self.ranks = None
        if tp_size > 1:
            from specray.runtime.transport.rank_groups import RankSet

            self.ranks = RankSet("draft", model, cache, tp_size, rank_opts or {"num_cpus": 0, "num_gpus": 0},
                                 tp_timeout_s, placement_timeout_s)
            self.worker = self.ranks.worker
            self.ranks.follow()
        else:
            self.worker = DraftWorker(model, cache)

    @ray.method(num_returns=2)
    def propose_msg(self, data: bytes):
        return self._locked_call("propose", data, None)

    @ray.method(num_returns=2)
    def predraft_msg(self, step_id: int):
        return self._locked_call("predraft", None, step_id)

    @ray.method(num_returns=2)
    def adopt_msg(self, data: bytes, chosen: list[int]):
        return self._locked_call("adopt", data, chosen)

    def _call(self, op: str, data: bytes | None, arg, tensors=()):
        if self.ranks is None:
            return self._run(op, data, arg)
        if self.ranks.broken():
            self._die("a rank of this tensor-parallel draft ended")
        try:
            return self._run(op, data, arg)
        except Exception as e:
            if self.worker.runner.group.broken or self.ranks.broken():
                self._die(f"this tensor-parallel draft lost a rank: {e}")
            raise

    @staticmethod
    def _die(why: str) -> None:
        """The group is broken: this process ends, and Ray starts the draft again (new ranks)."""
        log.warning("specray: %s; the draft actor restarts", why)
        os._exit(1)

    def _run(self, op: str, data: bytes | None, arg):
        if op == "propose":
            return self.worker.propose(decode(data, StepPlan, validate=False))
        if op == "predraft":
            return self.worker.predraft(arg)
        if op == "adopt":
            return self.worker.adopt(decode(data, StepPlan, validate=False), arg)
        raise ValueError(f"a draft worker has no call {op!r}")


RemoteDraftActor = ray.remote(DraftActor)


class DraftHandle(ActorHandle):
    def submit(self, plan):
        data = encode(plan)
        call = self._send("propose", data)
        if call is not None:
            return self._stamp(call)
        ref, probs = self.actor.propose_msg.remote(data)
        return self._stamp(ref), probs

    def wait(self, handle):
        return self._answer(handle, Proposals)

    def submit_predraft(self, step_id: int):
        call = self._send("predraft", None, step_id)
        return call if call is not None else self.actor.predraft_msg.remote(step_id)

    def submit_adopt(self, plan: StepPlan, chosen: list[int]):
        data = encode(plan)
        call = self._send("adopt", data, list(chosen))
        return call if call is not None else self.actor.adopt_msg.remote(data, list(chosen))

    def wait_predraft(self, handle):
        return self._answer(handle, Predraft)

    def _answer(self, handle, cls):
        """A call's message as ``cls``, and its probabilities (a tensor, or the ref to hand on)."""
        if not isinstance(handle, tuple):     # a link's call (or the error that stopped it)
            data, probs = self._get(handle)
            return decode(data, cls), probs
        ref, probs_ref = handle
        return decode(self._get(ref), cls), probs_ref
