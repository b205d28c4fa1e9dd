"""Start the draft and target workers and hand them to the engine as WorkerCalls.

On Ray each worker is an actor asking for exactly its configured resources (plus one GPU
on CUDA, ``num_cpus=0`` unless configured). Workers go into one placement group, one
bundle each, with the configured strategy (SPREAD by default: workers of one kind land on
distinct nodes when the cluster has them; PACK co-locates; STRICT_SPREAD insists).
Bundles must ask for something, so with no resources configured the actors are spread
by Ray's SPREAD scheduling instead.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

from specray.compiled_channel import CompiledChannel
from specray.config import RuntimeConfig
from specray.engine import LocalCall, WorkerCall, WorkerLost
from specray.scheduler.messages import Predraft, Proposals, StepPlan, StepResult, decode, encode
from specray.workers.worker_config import StaleCacheError, WorkerConfig
from specray.workers.ngram_proposer import NgramProposer


@dataclass
class WorkerPool:
    verifiers: list[WorkerCall]
    proposers: list[WorkerCall]
    target_blocks: list[int]
    draft_blocks: list[int] | None          # None: proposers without KV (n-gram) or none
    actors: list = field(default_factory=list)
    placement_group: Any = None

    def release(self) -> None:
        for call in self.verifiers + self.proposers:
            call.close()
        if not self.actors and self.placement_group is None:
            return
        import ray

        for a in self.actors:
            ray.kill(a)
        self.actors.clear()
        if self.placement_group is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self.placement_group)
            self.placement_group = None


class _RayWorkerCall:
    """A worker actor. When it dies Ray restarts it (``max_restarts``); meanwhile
    ``wait`` raises WorkerLost and ``alive`` watches, without blocking, for it to answer.
    With ``compiled``, step calls go through a compiled graph's channel to
    ``step_method``, rebuilt after each restart; classic calls if it cannot be built."""

    step_method = ""
    warm_up_args: tuple = ()

    def __init__(self, actor, max_restarts: int, compiled: bool = False) -> None:
        self.actor = actor
        self.max_restarts = max_restarts   # -1: Ray restarts it forever
        self.losses = 0
        self._ready = None        # a ready() call in flight while the actor is lost
        self._asked = 0.0
        self.channel = CompiledChannel(getattr(actor, self.step_method)) if compiled else None

    @property
    def _on_channel(self) -> bool:
        return self.channel is not None and not self.channel.failed

    def _execute(self, arg):
        """A compiled-graph call (``_on_channel``), or None: the graph cannot be built,
        use a classic call."""
        try:
            return self.channel.execute(arg)
        except Exception as e:   # noqa: BLE001 - e.g. its graph closed by a death: ``wait`` sorts it out
            return e

    def compiled(self) -> bool:
        return self.channel is not None and self.channel.live

    def warm_up(self) -> None:
        """Build the graph and run an empty step through it: a fresh graph's first
        execution may take seconds, which belong to startup, not to a request."""
        if self.channel is not None:
            self.wait(self.submit(StepPlan(), *self.warm_up_args))

    def close(self) -> None:
        if self.channel is not None:
            self.channel.close()

    def _get(self, ref):
        import ray

        try:
            if isinstance(ref, BaseException):
                raise ref
            return CompiledChannel.get(ref) if CompiledChannel.is_ref(ref) else ray.get(ref)
        except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError, ray.exceptions.RayChannelError) as e:
            if isinstance(e, ray.exceptions.RayTaskError) and not isinstance(e.cause, StaleCacheError):
                raise
            # A lost call or an empty restarted worker: either way one death (a worker
            # that is down gets no calls, so a death is not counted twice). Its graph
            # is closed with it; a new one is built once it answers again.
            self.losses += 1
            if self.channel is not None:
                self.channel.close()
            self._ask()
            raise WorkerLost(str(e)) from None

    def gone(self) -> bool:
        """Dead more often than Ray restarts it: it will not come back."""
        return 0 <= self.max_restarts < self.losses

    def alive(self) -> bool:
        import ray

        if self._ready is None:
            return True
        if self.gone():
            return False
        done, _ = ray.wait([self._ready], timeout=0)
        if not done:
            return False
        try:
            ray.get(self._ready)
        except ray.exceptions.RayActorError:
            # Called while Ray was still restarting it (or for good: then the engine's
            # timeout decides). Ask again, at most once a second.
            if time.monotonic() - self._asked >= 1.0:
                self._ask()
            return False
        self._ready = None
        return True

    def _ask(self) -> None:
        self._asked = time.monotonic()
        self._ready = self.actor.ready.remote()


class RayVerify(_RayWorkerCall):
    step_method = "verify_step"
    warm_up_args = ([],)

    def submit(self, plan, probs):
        data = encode(plan)
        if self._on_channel:
            import ray

            # A draft on classic calls hands over ObjectRefs; a channel carries values.
            ref = self._execute((data, [ray.get(p) if isinstance(p, ray.ObjectRef) else p for p in probs]))
            if ref is not None:
                return ref
        # ObjectRefs as top-level arguments: Ray resolves them on the target's node.
        return self.actor.verify_msg.remote(data, *probs)

    def wait(self, handle):
        return decode(self._get(handle), StepResult)


class RayPropose(_RayWorkerCall):
    step_method = "propose_step"

    def submit(self, plan):
        data = encode(plan)
        ref = self._execute(data) if self._on_channel else None
        return ref if ref is not None else self.actor.propose_msg.remote(data)

    def wait(self, handle):
        if not isinstance(handle, tuple):     # a compiled graph's one value (or its error)
            data, probs = self._get(handle)
            return decode(data, Proposals), probs
        ref, probs_ref = handle
        return decode(self._get(ref), Proposals), probs_ref


class RayPredraftPropose(RayPropose):
    """A draft worker actor that also pre-drafts while the target verifies (overlap).
    Actor calls: an actor runs them one after another, in the order submitted."""

    def submit_predraft(self, step_id: int):
        return self.actor.predraft_msg.remote(step_id)

    def submit_adopt(self, plan: StepPlan, chosen: list[int]):
        return self.actor.adopt_msg.remote(encode(plan), list(chosen))

    def wait_predraft(self, handle):
        ref, probs_ref = handle
        return decode(self._get(ref), Predraft), probs_ref


class LocalPredraftCall(LocalCall):
    """An in-process draft worker that pre-drafts: the same calls as the actor's, run at
    once (nothing overlaps in one thread; tests use it to check what overlap computes)."""

    def __init__(self, worker) -> None:
        super().__init__(worker.propose)
        self.worker = worker

    def submit_predraft(self, step_id: int):
        return self.worker.predraft(step_id)

    def submit_adopt(self, plan: StepPlan, chosen: list[int]):
        return self.worker.adopt(plan, chosen)

    def wait_predraft(self, handle):
        return handle


class StartCancelled(Exception):
    """The start was called off (its driver refused the configuration) before it ended."""


def start_workers(cfg: RuntimeConfig, backend: str,
                  cancel: threading.Event | None = None) -> WorkerPool:
    """``cancel``: once set, a start still waiting for placement or for its workers to
    load stops, releases what it took and raises StartCancelled. Loading a large model
    takes minutes; a driver that has already refused the configuration (a draft with
    another vocabulary) should not make its user wait for it."""
    cancel = cancel or threading.Event()
    if backend == "local":
        return _start_local(cfg, cancel)
    if backend != "ray":
        raise ValueError(f"backend must be 'ray' or 'local', got {backend!r}")
    return _start_ray(cfg, cancel)


def _check(cancel: threading.Event) -> None:
    if cancel.is_set():
        raise StartCancelled("the worker start was called off")


def _wait_all(refs: list, cancel: threading.Event, timeout: float | None = None) -> bool:
    """Wait for every ref, looking at ``cancel`` now and then; False on timeout."""
    import ray

    deadline = None if timeout is None else time.monotonic() + timeout
    pending = list(refs)
    while pending:
        _check(cancel)
        left = 0.2 if deadline is None else min(0.2, deadline - time.monotonic())
        if left <= 0:
            return False
        _, pending = ray.wait(pending, num_returns=len(pending), timeout=left)
    return True


def _ngram(cfg: RuntimeConfig) -> list[WorkerCall]:
    # Prompt lookup is cheap host work: it runs in the driver and costs no actor hop.
    return [LocalCall(NgramProposer(cfg.ngram_max, cfg.ngram_min).propose)]


def _start_local(cfg: RuntimeConfig, cancel: threading.Event) -> WorkerPool:
    from specray.workers.draft_worker import DraftWorker
    from specray.workers.target_worker import TargetWorker

    # In this process a model's load cannot be stopped halfway: look between workers.
    targets = []
    for _ in range(cfg.num_target_workers):
        _check(cancel)
        targets.append(TargetWorker(WorkerConfig.target_of(cfg.model, cfg.cache)))
    verifiers = [LocalCall(lambda plan, probs, t=t: t.verify(plan, *probs)) for t in targets]
    proposers, d_blocks = [], None
    if cfg.proposer == "draft":
        drafts = []
        for _ in range(cfg.num_draft_workers):
            _check(cancel)
            drafts.append(DraftWorker(WorkerConfig.draft_of(cfg.model, cfg.cache)))
        proposers = [LocalPredraftCall(d) if cfg.overlapped else LocalCall(d.propose) for d in drafts]
        d_blocks = [d.num_blocks() for d in drafts]
    elif cfg.proposer == "ngram":
        proposers = _ngram(cfg)
    return WorkerPool(verifiers, proposers, [t.num_blocks() for t in targets], d_blocks)


def _start_ray(cfg: RuntimeConfig, cancel: threading.Event) -> WorkerPool:
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from specray.worker_actors import RemoteDraftWorker, RemoteTargetWorker, actor_options

    gpu = cfg.device == "cuda" or (cfg.device == "auto" and ray.cluster_resources().get("GPU", 0) > 0)
    kinds = [("target", RemoteTargetWorker, WorkerConfig.target_of(cfg.model, cfg.cache),
               actor_options(cfg.target_resources, gpu)) for _ in range(cfg.num_target_workers)]
    if cfg.proposer == "draft":
        kinds += [("draft", RemoteDraftWorker, WorkerConfig.draft_of(cfg.model, cfg.cache),
                   actor_options(cfg.draft_resources, gpu)) for _ in range(cfg.num_draft_workers)]
    bundles = [_bundle(opts) for _, _, _, opts in kinds]
    pg = None
    if all(bundles):
        pg = placement_group(bundles, strategy=cfg.placement_strategy)
        try:
            placed = _wait_all([pg.ready()], cancel, cfg.placement_timeout_s)
        except BaseException:
            remove_placement_group(pg)
            raise
        if not placed:
            remove_placement_group(pg)
            raise RuntimeError(f"the cluster cannot place {len(bundles)} workers {bundles} with strategy "
                               f"{cfg.placement_strategy} within {cfg.placement_timeout_s:.0f}s")
    actors = []
    try:
        _check(cancel)
        for i, (kind, cls, wc, opts) in enumerate(kinds):
            if pg is not None:
                strategy = PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=i)
            else:
                strategy = "SPREAD"
            actors.append(cls.options(**opts, scheduling_strategy=strategy, max_restarts=cfg.max_worker_restarts,
                                      max_task_retries=0).remote(wc))
        targets = [a for (kind, *_), a in zip(kinds, actors) if kind == "target"]
        drafts = [a for (kind, *_), a in zip(kinds, actors) if kind == "draft"]
        t_refs = [a.num_blocks.remote() for a in targets]
        d_refs = [a.num_blocks.remote() for a in drafts]
        _wait_all(t_refs + d_refs, cancel)      # the models load: what a refusal stops
        t_blocks = ray.get(t_refs)
        d_blocks = ray.get(d_refs) if drafts else None
    except BaseException:
        for a in actors:
            ray.kill(a)
        if pg is not None:
            remove_placement_group(pg)
        raise
    restarts = cfg.max_worker_restarts
    verifiers = [RayVerify(a, restarts, cfg.compiled_graph) for a in targets]
    propose = RayPredraftPropose if cfg.overlapped else RayPropose
    remote_proposers = [propose(a, restarts, cfg.compiled_graph) for a in drafts]
    proposers = remote_proposers or (_ngram(cfg) if cfg.proposer == "ngram" else [])
    pool = WorkerPool(verifiers, proposers, t_blocks, d_blocks, actors, pg)
    if cfg.compiled_graph:
        try:
            for call in verifiers + remote_proposers:
                call.warm_up()
        except BaseException:
            pool.release()
            raise
    return pool


def _bundle(opts: dict) -> dict:
    b = {"CPU": opts.get("num_cpus", 0), "GPU": opts.get("num_gpus", 0), **opts.get("resources", {})}
    return {k: v for k, v in b.items() if v}
