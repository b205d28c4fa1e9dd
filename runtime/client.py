"""``SpecRuntime``: the client handle users hold."""

from __future__ import annotations

import os
import time
import warnings
from collections import deque
from typing import Iterator, Sequence as Seq

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from specray.runtime.chat import ChatPrompt, check_messages
from specray.runtime.config import ClusterConfig, RuntimeConfig
from specray.runtime.driver import REQUEST_ERROR, DriverInfo, Overloaded, RemoteDriver, SubmitReply, request_error
from specray.runtime import layout, ray_env
from specray.runtime.request_output import RequestOutput
from specray.scheduler.sampling_params import SamplingParams

_POLL_S = 1.0


class SpecRuntime:
    def __init__(self, config: RuntimeConfig) -> None:
        if not isinstance(config, RuntimeConfig):
            raise ValueError(f"config must be a RuntimeConfig, got {type(config).__name__}")
        cluster = config.cluster
        self._owns_ray = ray_env.acquire(cluster.ray_address, cluster.namespace, cluster.ray_connect_timeout_s)
        config = layout.resolve(config)
        cluster = config.cluster
        # Either layout's driver hosts a target worker, so it asks for the target's
        # resources and lands wherever those are (on an autoscaling cluster, a target node).
        # Asking for nothing, it lives on this process's node: the node that stays (head or
        # job node); not soft, because Ray's soft affinity moved it to other nodes in tests.
        from specray.runtime.actor_handle import actor_options

        device = config.model.device
        gpu = device == "cuda" or (device == "auto" and ray.cluster_resources().get("GPU", 0) > 0)
        if cluster.target_resources or gpu:
            opts = actor_options(cluster.target_resources, gpu)
        else:
            here = ray.get_runtime_context().get_node_id()
            opts = {"num_cpus": 0, "scheduling_strategy": NodeAffinitySchedulingStrategy(node_id=here, soft=False)}
        backend = layout.BACKENDS[config.cluster.layout]
        if cluster.name:
            opts.update(name=cluster.name, namespace=cluster.namespace)
        if cluster.detached:
            opts["lifetime"] = "detached"
        self._driver = RemoteDriver.options(**opts).remote(config, backend, True)
        self._attached = False
        self._closed = False
        try:
            info = ray.get(self._driver.info.remote())
        except Exception as e:
            # The driver failed to start (unplaceable workers, a worker that died loading, ...).
            self._abandon_start()
            raise RuntimeError(f"specray driver failed to start: {e}") from None
        if isinstance(info, str):
            # Bad input: a model path, a draft with another vocabulary, a window too small.
            self._abandon_start()
            raise ValueError(info)
        self._info: DriverInfo = info

    def _abandon_start(self) -> None:
        """Release what a failed start took (its workers go with the driver actor)."""
        ray.kill(self._driver)
        if self._owns_ray:
            ray_env.release()
        self._closed = True

    @classmethod
    def connect(cls, name: str = "specray", namespace: str = "specray", ray_address: str | None = None,
                timeout_s: float | None = None, *, address: str | None = None) -> "SpecRuntime":
        """Attach to a driver started elsewhere (``specray serve``). ``shutdown()`` on an
        attached handle detaches; the driver keeps serving.

        ``ray_address`` as in ``RuntimeConfig``, except that with nothing given (no Ray
        in this process, no ``RAY_ADDRESS``) it is "auto": the one cluster running on this
        machine. A cluster that does not answer within ``timeout_s`` (default:
        ``RuntimeConfig.ray_connect_timeout_s``'s) is a ValueError.
        ``address`` is the old name of ``ray_address``."""
        if address is not None:
            if ray_address is not None and ray_address != address:
                raise ValueError("give ray_address only (address is its old name)")
            warnings.warn("SpecRuntime.connect(address=...) is deprecated: use ray_address=", DeprecationWarning,
                          stacklevel=2)
            ray_address = address
        if ray_address is None and not ray.is_initialized() and not os.environ.get("RAY_ADDRESS"):
            ray_address = "auto"
        if timeout_s is None:
            timeout_s = ClusterConfig().ray_connect_timeout_s
        owns = ray_env.acquire(ray_address, namespace, timeout_s)
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
    def info(self) -> DriverInfo:
        """The driver's configuration and what it read from the models."""
        return self._info

    # -- requests ------------------------------------------------------------------
    def _params_list(self, n: int, params) -> list[SamplingParams]:
        if isinstance(params, (list, tuple)):
            plist = list(params)
            if len(plist) != n:
                raise ValueError(f"got {len(plist)} SamplingParams for {n} prompts")
        else:
            plist = [params if params is not None else SamplingParams()] * n
        for i, p in enumerate(plist):
            if not isinstance(p, SamplingParams):
                raise ValueError(f"request {i}: params must be SamplingParams, got {type(p).__name__}")
        return plist

    def _submit(self, prompts: list, plist: list[SamplingParams]) -> list[str]:
        reply: SubmitReply = ray.get(self._driver.submit.remote(prompts, plist))
        if reply.overloaded:
            raise Overloaded(reply.error)
        if reply.error:
            raise ValueError(reply.error)
        return reply.request_ids

    def generate(self, prompts: Seq, params: SamplingParams | list[SamplingParams] | None = None, *,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Outputs in the order of ``prompts`` (strings, token-id lists, or
        ``specray.runtime.chat.ChatPrompt`` conversations), for any number of them. ``use_tqdm``: a
        progress bar on stderr."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            raise ValueError("prompts must be a list of prompts (strings or token-id lists)")
        prompts = list(prompts)
        for i, p in enumerate(prompts):
            if not isinstance(p, (str, list, tuple, ChatPrompt)):
                raise ValueError(f"request {i}: prompt must be a string or a list of token ids, "
                                 f"got {type(p).__name__}")
        return self._run(prompts, self._params_list(len(prompts), params), use_tqdm)

    def chat(self, conversations: Seq, params: SamplingParams | list[SamplingParams] | None = None, *,
             use_tqdm: bool = False) -> list[RequestOutput]:
        """One output per conversation (a list of ``{"role", "content"}`` messages), the
        target tokenizer's chat template applied with the generation prompt. A target
        without a chat template is a ValueError."""
        if not isinstance(conversations, (list, tuple)) or (conversations and isinstance(conversations[0], dict)):
            raise ValueError("conversations must be a list of conversations, each a list of "
                             "{'role', 'content'} dicts")
        prompts = []
        for i, conv in enumerate(conversations):
            try:
                prompts.append(ChatPrompt(check_messages(conv)))
            except ValueError as e:
                raise ValueError(f"request {i}: {e}") from None
        return self._run(prompts, self._params_list(len(prompts), params), use_tqdm)

    def _run(self, prompts: list, plist: list[SamplingParams], use_tqdm: bool) -> list[RequestOutput]:
        """Submit and collect. The driver holds at most ``max_pending`` unfinished requests
        (online clients are refused past it); an offline call larger than what it has room
        for is checked whole, then fed in parts as earlier ones finish."""
        from tqdm import tqdm

        n = len(prompts)
        if not n:
            return []
        bar = tqdm(total=n, unit="req", disable=not use_tqdm, dynamic_ncols=True)
        try:
            room = self._info.config.max_pending
            if n <= room:
                try:
                    ids = self._submit(prompts, plist)
                except Overloaded:
                    pass         # other clients hold the room: feed it in parts below
                else:
                    outs = self._collect(ids)
                    bar.update(n)
                    return outs
            error = ray.get(self._driver.check.remote(prompts, plist))
            if error:
                raise ValueError(error)
            return self._feed(prompts, plist, max(1, room // 4), bar)
        finally:
            bar.close()

    def _collect(self, ids: list[str]) -> list[RequestOutput]:
        while True:
            outs = ray.get(self._driver.wait.remote(ids, _POLL_S))
            if outs is not None:
                return outs

    def _feed(self, prompts: list, plist: list[SamplingParams], part: int, bar) -> list[RequestOutput]:
        """Keep submitting parts of ``part`` requests while the driver takes them; when it
        is full, wait a moment on the oldest part (the room frees as any request finishes,
        delivered or not) and try again."""
        outs: list[RequestOutput | None] = [None] * len(prompts)
        running: deque[tuple[int, list[str]]] = deque()
        start = 0
        backoff = 0.05
        while start < len(prompts) or running:
            if start < len(prompts):
                end = min(start + part, len(prompts))
                try:
                    ids = self._submit(prompts[start:end], plist[start:end])
                except ValueError as e:
                    # Checked whole before; a refusal now names its index within the part.
                    m = REQUEST_ERROR.fullmatch(str(e))
                    raise ValueError(request_error(start + int(m[1]), m[2]) if m else str(e)) from None
                except Overloaded:
                    if not running:         # other clients fill it: wait for them
                        time.sleep(backoff)
                        backoff = min(2 * backoff, 1.0)
                        continue
                else:
                    running.append((start, ids))
                    start, backoff = end, 0.05
                    continue
            first, ids = running[0]
            done = ray.get(self._driver.wait.remote(ids, 0.1 if start < len(prompts) else _POLL_S))
            if done is not None:
                running.popleft()
                outs[first:first + len(done)] = done
                bar.update(len(done))
        return outs

    def stream(self, prompt, params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Yields the new part of the output as it is produced; the last one carries
        ``finish_reason``."""
        if not isinstance(prompt, (str, list, tuple)):
            raise ValueError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        (rid,) = self._submit([prompt], self._params_list(1, params))
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
