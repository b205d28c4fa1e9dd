"""The target worker as a Ray actor (``TargetActor``), and the driver's handle on it
(``TargetHandle``): a plan and the draft shards' probabilities in, a ``StepResult`` out."""

from __future__ import annotations

import ray

from specray.runtime.actor_handle import ActorHandle, WorkerActor
from specray.scheduler.config import CacheConfig
from specray.scheduler.messages import StepPlan, StepResult, decode, encode
from specray.workers.config import ModelConfig


class TargetActor(WorkerActor):
    def __init__(self, model: ModelConfig, cache: CacheConfig) -> None:
        from specray.workers.target_worker import TargetWorker   # in the actor: see DraftActor

        self.worker = TargetWorker(model, cache)

    def verify_msg(self, data: bytes, *draft_probs) -> bytes:
        return encode(self.worker.verify(decode(data, StepPlan, validate=False), *draft_probs))

    def verify_step(self, msg: tuple) -> bytes:
        """``(plan bytes, [draft probabilities])`` as one argument, for a compiled graph."""
        data, draft_probs = msg
        return self.verify_msg(data, *draft_probs)


RemoteTargetActor = ray.remote(TargetActor)


class TargetHandle(ActorHandle):
    step_method = "verify_step"
    warm_up_args = ([],)

    def submit(self, plan, probs):
        data = encode(plan)
        if self._on_channel:
            # A draft on classic calls hands over ObjectRefs; a channel carries values.
            ref = self._execute((data, [ray.get(p) if isinstance(p, ray.ObjectRef) else p for p in probs]))
            if ref is not None:
                return self._stamp(ref)
        # ObjectRefs as top-level arguments: Ray resolves them on the target's node.
        return self._stamp(self.actor.verify_msg.remote(data, *probs))

    def wait(self, handle):
        return decode(self._get(handle), StepResult)
