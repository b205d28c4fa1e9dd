"""``SpecRuntime``: the client handle users hold."""

from __future__ import annotations

from typing import Iterator, Sequence as Seq

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from specray.config import RuntimeConfig
from specray.driver import DriverCore, Overloaded, SubmitReply
from specray import ray_env
from specray.request_output import RequestOutput
from specray.scheduler.sampling_params import SamplingParams

class Driver(DriverCore):
    """The driver actor. Threaded, so stream polls and submits are answered while the
    step loop waits on workers."""

    def __init__(self, config: RuntimeConfig, backend: str, export_metrics: bool) -> None:
        # Ray hands the client only the text of an error raised while an actor is created,
        # so a refused configuration is kept and reported by info(), for the client to
        # raise as the ValueError it is.
        self.refused: str | None = None
        try:
            super().__init__(config, backend, export_metrics)
        except ValueError as e:
            self.refused = str(e)

    def info(self) -> dict:
        return {"refused": self.refused} if self.refused is not None else super().info()


RemoteDriver = ray.remote(max_concurrency=256)(Driver)

_POLL_S = 1.0


class SpecRuntime:
    def __init__(self, config: RuntimeConfig) -> None:
        if not isinstance(config, RuntimeConfig):
            raise ValueError(f"config must be a RuntimeConfig, got {type(config).__name__}")
        self._owns_ray = ray_env.acquire(config.ray_address, config.namespace)
        # The driver lives on this process's node: on an autoscaling cluster that is the
        # node that stays (head or job node), not a worker node that may be taken away with
        # every request's state. It needs no resources, so any node can host it; not soft,
        # because Ray's soft affinity moved it to other nodes in tests.
        here = ray.get_runtime_context().get_node_id()
        opts = {"num_cpus": 0, "scheduling_strategy": NodeAffinitySchedulingStrategy(node_id=here, soft=False)}
        backend = "ray"
        if config.colocate:
            # One process hosts driver, draft and target: it asks for the target's resources.
            from specray.worker_actors import actor_options

            gpu = config.device == "cuda" or (config.device == "auto" and ray.cluster_resources().get("GPU", 0) > 0)
            opts = actor_options(config.target_resources, gpu)   # wherever those are
            backend = "local"
        if config.name:
            opts.update(name=config.name, namespace=config.namespace)
        if config.detached:
            opts["lifetime"] = "detached"
        self._driver = RemoteDriver.options(**opts).remote(config, backend, True)
        self._attached = False
        self._closed = False
        try:
            self._info = ray.get(self._driver.info.remote())
        except Exception as e:
            # The driver failed to start (unplaceable workers, a worker that died loading, ...).
            self._abandon_start()
            raise RuntimeError(f"specray driver failed to start: {e}") from None
        if "refused" in self._info:
            # Bad input: a model path, a draft with another vocabulary, a window too small.
            self._abandon_start()
            raise ValueError(self._info["refused"])

    def _abandon_start(self) -> None:
        """Release what a failed start took (its workers go with the driver actor)."""
        ray.kill(self._driver)
        if self._owns_ray:
            ray_env.release()
        self._closed = True

    @classmethod
    def connect(cls, name: str = "specray", namespace: str = "specray",
                address: str | None = None) -> "SpecRuntime":
        """Attach to a driver started elsewhere (``specray serve``). ``shutdown()`` on an
        attached handle detaches; the driver keeps serving."""
        owns = ray_env.acquire(address if address is not None or ray.is_initialized() else "auto", namespace)
        try:
            driver = ray.get_actor(name, namespace=namespace)
        except ValueError:
            if owns:
                ray_env.release()
            raise ValueError(f"no specray driver named {name!r} in namespace {namespace!r} is running") from None
        self = cls.__new__(cls)
        self._owns_ray = owns
        self._attached = True
        self._driver = driver
        self._info = ray.get(driver.info.remote())
        self._closed = False
        return self

    @property
    def info(self) -> dict:
        return dict(self._info)

    # -- requests ------------------------------------------------------------------
    def _submit(self, prompts: list, params) -> list[str]:
        if isinstance(params, (list, tuple)):
            plist = list(params)
            if len(plist) != len(prompts):
                raise ValueError(f"got {len(plist)} SamplingParams for {len(prompts)} prompts")
        else:
            plist = [params if params is not None else SamplingParams()] * len(prompts)
        for i, p in enumerate(plist):
            if not isinstance(p, SamplingParams):
                raise ValueError(f"request {i}: params must be SamplingParams, got {type(p).__name__}")
        reply: SubmitReply = ray.get(self._driver.submit.remote(prompts, plist))
        if reply.overloaded:
            raise Overloaded(reply.error)
        if reply.error:
            raise ValueError(reply.error)
        return reply.request_ids

    def generate(self, prompts: Seq, params: SamplingParams | list[SamplingParams] | None = None) -> list[RequestOutput]:
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            raise ValueError("prompts must be a list of prompts (strings or token-id lists)")
        ids = self._submit(list(prompts), params)
        if not ids:
            return []
        while True:
            outs = ray.get(self._driver.wait.remote(ids, _POLL_S))
            if outs is not None:
                return outs

    def stream(self, prompt, params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Yields the new part of the output as it is produced; the last one carries
        ``finish_reason``."""
        (rid,) = self._submit([prompt], params)
        while True:
            delta = ray.get(self._driver.poll.remote(rid, _POLL_S))
            if delta is None:
                continue
            if delta.token_ids or delta.finished:
                yield delta
            if delta.finished:
                return

    def metrics(self) -> dict:
        return ray.get(self._driver.metrics.remote())

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            if not self._attached:
                ray.get(self._driver.shutdown.remote(), timeout=60)
        finally:
            if not self._attached:
                ray.kill(self._driver)
            if self._owns_ray:
                ray_env.release()

    def __enter__(self) -> "SpecRuntime":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
