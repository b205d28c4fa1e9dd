"""Start the draft and target workers and hand them to the engine as WorkerCalls.

On Ray each worker is an actor asking for exactly its configured resources (plus one GPU
on CUDA, ``num_cpus=0`` unless configured), and holds at most its own share of that GPU's
memory (``CacheConfig.gpu_memory_utilization``, default 0.9 times the part of a GPU it asks
for): workers that load at the same time on one GPU each size their KV cache from their
own share, not from the free memory the other has not taken yet. Workers in this process
(co-located) are loaded first and sized together from the process's share, the same
number of blocks each. Workers go into one placement group, one
bundle each, with the configured strategy (SPREAD by default: workers of one kind land on
distinct nodes when the cluster has them; PACK co-locates; STRICT_SPREAD insists).
Bundles must ask for something, so with no resources configured the actors are spread
by Ray's SPREAD scheduling instead. In the actor layout the first target
worker is not an actor: it loads in this process, the driver's actor, which asked Ray for
the target's resources itself.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any

from specray.runtime.config import RuntimeConfig
from specray.runtime.transport.draft_proposer import DraftModelProposer
from specray.runtime.transport.worker_call import LocalCall, LocalDraftCall, WorkerCall
from specray.scheduler.config import DEFAULT_GPU_MEMORY_UTILIZATION, CacheConfig, SpeculationConfig
from specray.scheduler.proposers.in_target import InTargetProposer
from specray.scheduler.proposers.merged import MergedProposer
from specray.scheduler.proposers.ngram import NgramProposer
from specray.scheduler.proposers.proposer import NoProposer, Proposer
from specray.scheduler.proposers.suffix import SuffixProposer
from specray.workers.config import ModelConfig


@dataclass
class WorkerPool:
    verifiers: list[WorkerCall]
    proposer: Proposer                      # every proposer, one object (``build_proposer``)
    target_blocks: list[int]
    draft_blocks: list[int] | None          # None: proposers without KV (n-gram, suffix) or none
    actors: list = field(default_factory=list)
    placement_group: Any = None
    draft_calls: list[WorkerCall] = field(default_factory=list)   # the draft model's workers (its ranks)
    local_workers: list = field(default_factory=list)   # model workers in this process (co-located)

    def graph_stats(self, timeout_s: float = 5.0) -> list[dict | None]:
        """Each model worker's ``graph_stats()`` (targets, then drafts); None for an actor
        that did not answer within ``timeout_s`` (dead, restarting, or busy past it)."""
        out: list[dict | None] = [w.graph_stats() for w in self.local_workers]
        if self.actors:
            import ray

            refs = [a.graph_stats.remote() for a in self.actors]
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
            done = set(ready)
            for ref in refs:
                try:
                    out.append(ray.get(ref) if ref in done else None)
                except Exception:  # noqa: BLE001 - a dead worker has no figures, the metrics still answer
                    out.append(None)
        return out

    def release(self) -> None:
        for call in self.verifiers:
            call.close()
        self.proposer.close()
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


class StartCancelled(Exception):
    """The start was called off (its driver refused the configuration) before it ended."""


def start_workers(cfg: RuntimeConfig, cancel: threading.Event | None = None) -> WorkerPool:
    """The workers of ``cfg``'s settled layout (``specray.runtime.layout.settle``):
    "colocated", all in this process; "actors", the first target worker in this process
    and the rest actors. ``cancel``: once set, a start still waiting for placement or for its workers to
    load stops, releases what it took and raises StartCancelled. Loading a large model
    takes minutes; a driver that has already refused the configuration (a draft with
    another vocabulary) should not make its user wait for it."""
    cancel = cancel or threading.Event()
    if cfg.cluster.layout == "colocated":
        return _start_local(cfg, cancel)
    return _start_actors(cfg, cancel)


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


def build_proposer(spec: SpeculationConfig, draft_calls: list[WorkerCall]) -> Proposer:
    """The configured proposer, where its inputs are: the draft model on its workers
    (``draft_calls``, one rank each); prompt lookup and suffix decoding in this process,
    the driver's (cheap host work, no hop); an EAGLE-3 head in the target worker; a model
    and suffix decoding merged per sequence for "draft+suffix" and "eagle3+suffix"."""
    if spec.proposer == "ngram":
        return NgramProposer(spec)
    if spec.proposer == "suffix":
        return SuffixProposer(spec)
    if spec.head:
        # An EAGLE-3 head proposes inside its target worker's verify (``TargetWorker.head``).
        head = InTargetProposer()
        return MergedProposer(head, SuffixProposer(spec)) if spec.suffix else head
    if not spec.draft_model:
        return NoProposer()
    drafts = DraftModelProposer(draft_calls, predraft=spec.overlap)
    return MergedProposer(drafts, SuffixProposer(spec)) if spec.suffix else drafts


def _start_local(cfg: RuntimeConfig, cancel: threading.Event) -> WorkerPool:
    from specray.workers.draft_worker import DraftWorker
    from specray.workers.memory_budget import plan_blocks
    from specray.workers.target_worker import TargetWorker

    # In this process a model's load cannot be stopped halfway: look between workers.
    cluster = cfg.cluster
    targets, drafts, groups = [], [], []
    try:
        for _ in range(cluster.num_target_workers):
            _check(cancel)
            if cluster.tensor_parallel_size > 1:
                groups.append(_target_group(cfg, cfg.cache, allocate=False))
                targets.append(groups[-1].worker)
            else:
                targets.append(TargetWorker(worker_model(cfg, "target"), cfg.cache, allocate=False,
                                            head=_head(cfg)))
        if cfg.speculation.draft_model:
            for _ in range(cluster.num_draft_workers):
                _check(cancel)
                drafts.append(DraftWorker(worker_model(cfg, "draft"), cfg.cache, allocate=False))
        workers = targets + drafts
        # Every model is in before any cache is sized: they share this process's part of the GPU.
        share = cfg.cache.gpu_memory_utilization or DEFAULT_GPU_MEMORY_UTILIZATION * _gpu_part(cluster.target_resources)
        blocks = [cfg.cache.num_kv_blocks] * len(workers) if cfg.cache.num_kv_blocks else \
            plan_blocks([w.runner.need for w in workers], share)
        for w, b in zip(workers, blocks):
            _check(cancel)
            w.runner.allocate(b)
    except BaseException:
        for g in groups:            # else their rank actors and placement outlive the failed start
            g.stop()
        raise
    if groups:
        for g in groups:
            g.follow()
        # Groups past the first verify on threads of their own, beside the first.
        verifiers = [_group_call(g, cluster, threaded=i > 0) for i, g in enumerate(groups)]
    else:
        verifiers = [LocalCall(lambda plan, probs, t=t: t.verify(plan, *probs)) for t in targets]
    calls = [LocalDraftCall(d) if cfg.speculation.overlap else LocalCall(d.propose) for d in drafts]
    d_blocks = [d.num_blocks() for d in drafts] if drafts else None
    return WorkerPool(verifiers, build_proposer(cfg.speculation, calls), [t.num_blocks() for t in targets],
                      d_blocks, draft_calls=calls, local_workers=workers)


def _head(cfg: RuntimeConfig) -> str | None:
    """The EAGLE-3 head a target worker runs (``proposer="eagle3"``), else None."""
    return cfg.model.draft if cfg.speculation.head else None




def worker_model(cfg: RuntimeConfig, kind: str) -> ModelConfig:
    """The model section a ``kind`` ("target" or "draft") worker is built with: the
    uniform steps it will be sent, for its CUDA graphs, unless configured."""
    if cfg.model.cuda_graph_query_lens:
        return cfg.model
    k = cfg.speculation.num_speculative_tokens
    lens = (1, 2) if kind == "draft" else tuple(sorted({1, k + 1}))
    return replace(cfg.model, cuda_graph_query_lens=lens)


def _gpu_part(resources: dict) -> float:
    """The part of one GPU a worker asking Ray for ``resources`` holds (one GPU unless named)."""
    return min(1.0, float(resources.get("GPU", 1)) or 1.0)


def worker_cache(cache: CacheConfig, gpu_part: float) -> CacheConfig:
    """The cache section one GPU worker actor is built with: its own memory share."""
    if cache.gpu_memory_utilization is not None or gpu_part <= 0:
        return cache
    return replace(cache, gpu_memory_utilization=DEFAULT_GPU_MEMORY_UTILIZATION * min(1.0, gpu_part))


def _start_actors(cfg: RuntimeConfig, cancel: threading.Event) -> WorkerPool:
    """The actor layout: the first target worker loads in this process (while the actors
    load in theirs) and is called in place; the engine verifies its shard after sending
    the other target workers theirs."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from specray.runtime.transport.actor_handle import actor_options
    from specray.runtime.transport.draft_actor import DraftHandle, RemoteDraftActor
    from specray.runtime.transport.target_actor import RemoteTargetActor, TargetHandle, probs_values

    cluster, device = cfg.cluster, cfg.model.device
    gpu = device == "cuda" or (device == "auto" and ray.cluster_resources().get("GPU", 0) > 0)
    # Tensor parallel: every group's rank 0 runs here, its other ranks on actors of their own
    # (``rank_groups``); data-parallel target actors are whole models.
    tp = cluster.tensor_parallel_size > 1
    kinds = [("target", RemoteTargetActor, actor_options(cluster.target_resources, gpu))
             for _ in range(0 if tp else cluster.num_target_workers - 1)]
    if cfg.speculation.draft_model:
        kinds += [("draft", RemoteDraftActor, actor_options(cluster.draft_resources, gpu))
                  for _ in range(cluster.num_draft_workers)]
    bundles = [_bundle(opts) for _, _, opts in kinds]
    pg = None
    if bundles and all(bundles):
        from specray.runtime.driver.restarts import worker_group_name

        pg = placement_group(bundles, strategy=cluster.placement_strategy, name=worker_group_name())
        try:
            placed = _wait_all([pg.ready()], cancel, cluster.placement_timeout_s)
        except BaseException:
            remove_placement_group(pg)
            raise
        if not placed:
            remove_placement_group(pg)
            raise RuntimeError(f"the cluster cannot place {len(bundles)} workers {bundles} with strategy "
                               f"{cluster.placement_strategy} within {cluster.placement_timeout_s:.0f}s")
    actors, groups = [], []
    try:
        _check(cancel)
        for i, (kind, cls, opts) in enumerate(kinds):
            if pg is not None:
                strategy = PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=i)
            else:
                strategy = "SPREAD"
            # A tensor-parallel draft's actor is its rank 0: it starts the other ranks, asking for what it asks.
            dtp = cluster.draft_tensor_parallel_size if kind == "draft" else 1
            tp_args = (dtp, opts, cluster.tensor_parallel_timeout_s, cluster.placement_timeout_s) if dtp > 1 else ()
            actors.append(cls.options(**opts, scheduling_strategy=strategy, max_restarts=cluster.max_worker_restarts,
                                      max_task_retries=0).remote(worker_model(cfg, kind),
                                                                 worker_cache(cfg.cache, opts["num_gpus"]), *tp_args))
        targets = [a for (kind, *_), a in zip(kinds, actors) if kind == "target"]
        drafts = [a for (kind, *_), a in zip(kinds, actors) if kind == "draft"]
        t_refs = [a.num_blocks.remote() for a in targets]
        d_refs = [a.num_blocks.remote() for a in drafts]
        if tp:
            part = _gpu_part(cluster.target_resources) if gpu else 0
            for _ in range(cluster.num_target_workers):
                _check(cancel)
                groups.append(_target_group(cfg, worker_cache(cfg.cache, part)))
            local = groups[0].worker
        else:
            local = _host_target(cfg, gpu, cancel)
        _wait_all(t_refs + d_refs, cancel)      # the models load: what a refusal stops
        t_blocks = ([g.worker.num_blocks() for g in groups] if tp else [local.num_blocks()]) + ray.get(t_refs)
        d_blocks = ray.get(d_refs) if drafts else None
    except BaseException:
        for g in groups:
            g.stop()
        for a in actors:
            ray.kill(a)
        if pg is not None:
            remove_placement_group(pg)
        raise
    restarts = cluster.max_worker_restarts
    if tp:
        for g in groups:
            g.follow()
        # Groups past the first verify on threads of their own, beside the first.
        verifiers = [_group_call(g, cluster, threaded=i > 0) for i, g in enumerate(groups)]
    else:
        verifiers = [LocalCall(lambda plan, probs, t=local: t.verify(plan, *probs_values(probs)))]
    verifiers += [TargetHandle(a, restarts, link=cluster.worker_link) for a in targets]
    calls = [DraftHandle(a, restarts, link=cluster.worker_link) for a in drafts]
    pool = WorkerPool(verifiers, build_proposer(cfg.speculation, calls), t_blocks, d_blocks, actors, pg,
                      draft_calls=calls, local_workers=[g.worker for g in groups] or [local])
    if cluster.worker_link:
        # Links open now, not in a request's first step.
        try:
            for call in verifiers + calls:
                if not getattr(call, "inline", False):
                    call.warm_up()
        except BaseException:
            pool.release()
            raise
    return pool


def _host_target(cfg: RuntimeConfig, gpu: bool, cancel: threading.Event):
    """The target worker of this process (the driver's actor, which asked for the
    target's resources), sized from its own share of the GPU as an actor would be."""
    from specray.workers.target_worker import TargetWorker

    _check(cancel)
    part = _gpu_part(cfg.cluster.target_resources) if gpu else 0
    return TargetWorker(worker_model(cfg, "target"), worker_cache(cfg.cache, part), head=_head(cfg))


def _target_group(cfg: RuntimeConfig, cache: CacheConfig, allocate: bool = True):
    """A tensor-parallel target: rank 0 here, the other ranks actors on this node."""
    import ray

    from specray.runtime.transport.actor_handle import actor_options
    from specray.runtime.transport.rank_groups import RankSet

    cluster, device = cfg.cluster, cfg.model.device
    gpu = device == "cuda" or (device == "auto" and ray.cluster_resources().get("GPU", 0) > 0)
    return RankSet("target", worker_model(cfg, "target"), cache, cluster.tensor_parallel_size,
                   actor_options(cluster.target_resources, gpu), cluster.tensor_parallel_timeout_s,
                   cluster.placement_timeout_s, allocate=allocate)


def _group_call(group, cluster, threaded: bool = False):
    from specray.runtime.transport.rank_groups import GroupCall

    return GroupCall(group, cluster.max_worker_restarts, threaded)


def _bundle(opts: dict) -> dict:
    b = {"CPU": opts.get("num_cpus", 0), "GPU": opts.get("num_gpus", 0), **opts.get("resources", {})}
    return {k: v for k, v in b.items() if v}
