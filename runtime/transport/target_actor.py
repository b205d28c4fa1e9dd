"""The target worker as a Ray actor (``TargetActor``), and the driver's handle on it
(``TargetHandle``): a plan and the draft shards' probabilities in, a ``StepResult`` out.

In the actor layout these are the target workers past the one the driver's actor hosts
(data parallel). With a link (``specray.runtime.transport.worker_link``) their calls go on the
actor's own socket, probabilities sent along as tensors."""

from __future__ import annotations

import ray

from specray.runtime.transport.actor_handle import ActorHandle, WorkerActor
from specray.scheduler.config import CacheConfig
from specray.scheduler.messages import StepPlan, StepResult, decode, encode
from specray.workers.config import ModelConfig


class TargetActor(WorkerActor):
    def __init__(self, model: ModelConfig, cache: CacheConfig) -> None:
        from specray.workers.target_worker import TargetWorker  # in the actor: see DraftActor

        super().__init__()
        self.worker = TargetWorker(model, cache)

    def verify_msg(self, data: bytes, *draft_probs) -> bytes:
        return self._locked_call("verify", data, None, draft_probs)[0]

    def _call(self, op: str, data: bytes | None, arg, tensors=()):
        if op == "verify":
            return self.worker.verify(decode(data, StepPlan, validate=False), *tensors), None
        raise ValueError(f"a target worker has no call {op!r}")


RemoteTargetActor = ray.remote(TargetActor)


class TargetHandle(ActorHandle):
    warm_up_args = ([],)

    def submit(self, plan, probs):
        data = encode(plan)
        if self._link_wanted and not self._link_failed:
            call = self._send("verify", data, tensors=probs_values(probs))
            if call is not None:
                return self._stamp(call)
        # ObjectRefs as top-level arguments: Ray resolves them on the target's node.
        return self._stamp(self.actor.verify_msg.remote(data, *probs))

    def wait(self, handle):
        got = self._get(handle)          # a link's reply is (message, no tensor)
        return decode(got[0] if isinstance(got, tuple) else got, StepResult)


def probs_values(probs: list) -> list:
    """Draft probabilities as tensors: draft actors on Ray calls hand over ObjectRefs, which
    Ray resolves for an actor call's arguments but not for a link or an in-process call."""
    refs = [i for i, p in enumerate(probs) if isinstance(p, ray.ObjectRef)]
    got = ray.get([probs[i] for i in refs]) if refs else []
    out = list(probs)
    for i, v in zip(refs, got):
        out[i] = v
    return out
