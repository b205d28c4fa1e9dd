"""Ray actor classes around the in-process workers: msgpack in, msgpack out.

Draft probabilities are a second return value, so the driver receives an ObjectRef it
hands to the target worker without fetching the tensor. Plans are decoded without their
cross-field checks: the workers' entry points run those for every caller, once.
"""

from __future__ import annotations

import ray

from specray.scheduler.messages import StepPlan, decode, encode
from specray.workers.worker_config import WorkerConfig


class _WorkerActor:
    """What the driver asks of either kind of worker actor besides its step."""

    worker: object

    def num_blocks(self) -> int:
        return self.worker.num_blocks()

    def ready(self) -> bool:
        return True


class DraftWorker(_WorkerActor):
    def __init__(self, cfg: WorkerConfig) -> None:
        # Imported in the actor, not here: the driver process names these classes to start
        # the actors, and importing the workers (torch, transformers: seconds) there would
        # only delay the moment they start loading.
        from specray.workers.draft_worker import DraftWorker as Worker

        self.worker = Worker(cfg)

    @ray.method(num_returns=2)
    def propose_msg(self, data: bytes):
        return self.propose_step(data)

    def propose_step(self, data: bytes) -> tuple[bytes, object]:
        """One return value, for a compiled graph's channel."""
        return _reply(*self.worker.propose(decode(data, StepPlan, validate=False)))

    @ray.method(num_returns=2)
    def predraft_msg(self, step_id: int):
        return _reply(*self.worker.predraft(step_id))

    @ray.method(num_returns=2)
    def adopt_msg(self, data: bytes, chosen: list[int]):
        return _reply(*self.worker.adopt(decode(data, StepPlan, validate=False), chosen))


def _reply(message, probs) -> tuple[bytes, object]:
    # Tensors leave the actor on the host so any node can read them.
    return encode(message), (probs.cpu() if probs is not None else None)


class TargetWorker(_WorkerActor):
    def __init__(self, cfg: WorkerConfig) -> None:
        from specray.workers.target_worker import TargetWorker as Worker

        self.worker = Worker(cfg)

    def verify_msg(self, data: bytes, *draft_probs) -> bytes:
        return encode(self.worker.verify(decode(data, StepPlan, validate=False), *draft_probs))

    def verify_step(self, msg: tuple) -> bytes:
        """``(plan bytes, [draft probabilities])`` as one argument, for a compiled graph."""
        data, draft_probs = msg
        return self.verify_msg(data, *draft_probs)


def actor_options(resources: dict[str, float], gpu: bool) -> dict:
    """Exactly the configured resources (num_cpus 0 unless named), plus one GPU on CUDA."""
    res = dict(resources)
    opts = {"num_cpus": res.pop("CPU", 0), "num_gpus": res.pop("GPU", 1 if gpu else 0)}
    if res:
        opts["resources"] = res
    return opts


RemoteDraftWorker = ray.remote(DraftWorker)
RemoteTargetWorker = ray.remote(TargetWorker)
