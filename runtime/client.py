"""``SpecRuntime``: the client handle users hold."""

from __future__ import annotations

import os
import threading
import time
import warnings
from collections import deque
from typing import Iterator
from typing import Sequence as Seq

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from specray.runtime import layout, ray_env
from specray.runtime.chat import ChatPrompt, check_messages
from specray.runtime.config import ClusterConfig, RuntimeConfig
from specray.runtime.driver.actor import RemoteDriver
from specray.runtime.driver.replies import REQUEST_ERROR, DriverInfo, Overloaded, SubmitReply, request_error
from specray.runtime.driver.restarts import DriverGone, actor_errors, wait_for_driver
from specray.runtime.driver.resume import InFlight, WaitReply
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
        from specray.runtime.transport.actor_handle import actor_options

        device = config.model.device
        gpu = device == "cuda" or (device == "auto" and ray.cluster_resources().get("GPU", 0) > 0)
        if cluster.target_resources or gpu:
            opts = actor_options(cluster.target_resources, gpu)
        else:
            here = ray.get_runtime_context().get_node_id()
            opts = {"num_cpus": 0, "scheduling_strategy": NodeAffinitySchedulingStrategy(node_id=here, soft=False)}
        if cluster.name:
            opts.update(name=cluster.name, namespace=cluster.namespace)
        if cluster.detached:
            opts["lifetime"] = "detached"
        # Ray restarts a dead driver; this handle resumes its requests on the new one.
        opts.update(max_restarts=cluster.max_driver_restarts, max_task_retries=0)
        self._driver = RemoteDriver.options(**opts).remote(config, True)
        self._attached = False
        self._closed = False
        self._track(cluster.driver_restart_timeout_s)
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

    def _track(self, restart_timeout_s: float) -> None:
        self._inflight = InFlight()
        self._recovering = threading.Lock()
        self._restart_timeout_s = restart_timeout_s
        self._lost = actor_errors()

    def _abandon_start(self) -> None:
        """Release what a failed start took (its workers go with the driver actor)."""
        ray.kill(self._driver)
        if self._owns_ray:
            ray_env.release()
        self._closed = True

    @classmethod
    def connect(cls, name: str = "specray", namespace: str = "specray", ray_address: str | None = None,
                timeout_s: float | None = None, *, address: str | None = None,
                restart_timeout_s: float | None = None) -> "SpecRuntime":
        """Attach to a driver started elsewhere (``specray serve``). ``shutdown()`` on an
        attached handle detaches; the driver keeps serving.

        ``ray_address`` as in ``RuntimeConfig``, except that with nothing given (no Ray
        in this process, no ``RAY_ADDRESS``) it is "auto": the one cluster running on this
        machine. A cluster that does not answer within ``timeout_s`` (default:
        ``RuntimeConfig.ray_connect_timeout_s``'s) is a ValueError.
        ``address`` is the old name of ``ray_address``. ``restart_timeout_s`` (default:
        ``RuntimeConfig.driver_restart_timeout_s``'s): how long a call waits for a driver that
        died to serve again, its requests resumed, before it raises ``DriverGone``."""
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
        self._track(ClusterConfig().driver_restart_timeout_s if restart_timeout_s is None else restart_timeout_s)
        self._info = self._call("info")
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

    # -- riding out a driver restart ---------------------------------------------------
    def _call(self, method: str, *args):
        """A driver call that nothing is lost by repeating, repeated on the restarted
        driver where the driver died under it."""
        while True:
            epoch = self._inflight.epoch
            try:
                return ray.get(getattr(self._driver, method).remote(*args))
            except self._lost as e:
                self._recover(epoch, type(e).__name__)

    def _recover(self, epoch: int, why: str) -> None:
        """The driver died (a call failed, or it no longer knows this handle's requests):
        wait for Ray to restart it, then resubmit every request this handle holds, each
        from the output received so far. Once per death, whichever thread gets here first
        (``epoch``: the resubmissions the failed call had seen)."""
        with self._recovering:
            if self._inflight.epoch != epoch:
                return                    # another thread resumed them since that call began
            deadline = time.monotonic() + self._restart_timeout_s
            while True:
                wait_for_driver(self._driver, deadline, why)
                tracked, prompts, plist, resumes = self._inflight.resubmissions()
                reply = None
                try:
                    if tracked:
                        # A driver that was only out of reach still runs them: stop those first.
                        ray.get(self._driver.abort.remote([t.driver_id for t in tracked]))
                        reply = ray.get(self._driver.submit.remote(prompts, plist, resumes))
                except self._lost as e:
                    why = f"{type(e).__name__} while resuming"     # killed again: wait again
                    continue
                if reply is not None and reply.error:
                    raise DriverGone(f"the restarted specray driver refused to resume the requests: {reply.error}")
                self._inflight.moved(tracked, reply.request_ids if reply else [])
                return

    def _submit(self, prompts: list, plist: list[SamplingParams]) -> list[str]:
        while True:
            epoch = self._inflight.epoch
            try:
                reply: SubmitReply = ray.get(self._driver.submit.remote(prompts, plist))
                break
            except self._lost as e:
                # What the dead driver accepted died with it: submitting again repeats nothing.
                self._recover(epoch, type(e).__name__)
        if reply.overloaded:
            raise Overloaded(reply.error)
        if reply.error:
            raise ValueError(reply.error)
        self._inflight.add(reply.request_ids, prompts, plist, reply.seeds)
        return reply.request_ids

    def _wait(self, ids: list[str], timeout: float) -> list[RequestOutput] | None:
        """One wait on these requests (the ids their caller knows): their outputs once all
        have finished, else None. What the driver has computed so far is kept, in whole
        steps, so that a restarted driver resumes them from there."""
        epoch = self._inflight.epoch
        cur = self._inflight.current(ids)
        tracked = [self._inflight.get(r) for r in ids]
        have = [len(t.token_ids) for t in tracked]
        try:
            reply: WaitReply = ray.get(self._driver.wait_progress.remote(cur, have, timeout))
        except self._lost as e:
            self._recover(epoch, type(e).__name__)
            return None
        if reply.unknown:
            self._recover(epoch, f"the driver no longer holds request {reply.unknown[0]}: it restarted")
            return None
        if reply.outputs is not None:
            self._inflight.forget(ids)
            return [t.output(o) for t, o in zip(tracked, reply.outputs)]
        by_id = dict(zip(cur, ids))
        for p in reply.progress:
            self._inflight.received(by_id[p.request_id], p.request_id, p, delta=False)
        return None

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
            error = self._call("check", prompts, plist)
            if error:
                raise ValueError(error)
            return self._feed(prompts, plist, max(1, room // 4), bar)
        finally:
            bar.close()

    def _collect(self, ids: list[str]) -> list[RequestOutput]:
        while True:
            outs = self._wait(ids, _POLL_S)
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
            done = self._wait(ids, 0.1 if start < len(prompts) else _POLL_S)
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
        finished, cur = False, rid
        try:
            while True:
                epoch = self._inflight.epoch
                (cur,) = self._inflight.current([rid])
                try:
                    reply = ray.get(self._driver.poll_many.remote([cur], _POLL_S))
                except self._lost as e:
                    self._recover(epoch, type(e).__name__)
                    continue
                if reply.unknown:
                    self._recover(epoch, "the driver no longer holds the request: it restarted")
                    continue
                if reply.errors:
                    raise RuntimeError(reply.errors[cur])
                for delta in reply.deltas:
                    if not self._inflight.received(rid, cur, delta, delta=True):
                        continue       # sent again by the driver now serving it
                    delta.request_id = rid
                    finished = delta.finished
                    if delta.token_ids or delta.finished:
                        yield delta
                    if finished:
                        return
        finally:
            self._inflight.forget([rid])
            if not finished:
                self._abort_quietly(rid, cur)

    def _abort_quietly(self, rid: str, cur: str) -> None:
        """A stream its caller left (or that failed): the driver stops computing it."""
        try:
            self._driver.abort.remote([cur])
        except Exception:  # noqa: BLE001 - a driver that is gone holds nothing to stop
            pass

    def metrics(self) -> dict:
        return self._call("metrics")

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
