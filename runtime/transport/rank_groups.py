"""Tensor-parallel workers: a group's rank 0 where the worker would run whole, its other
ranks Ray actors (``TargetRankActor``, ``DraftRankActor``); and the driver's
``WorkerCall`` on a target group whose rank 0 is in its process (``GroupCall``).

Start (``RankSet``): the process of rank 0 hosts the group's rendezvous (a torch
``TCPStore`` on a free port of its node), reserves one bundle a rank past 0 in a
``STRICT_PACK`` placement group pinned to its own node (the ranks meet in collectives
every layer: they share a node), and starts the rank actors; every rank, rank 0 included,
joins the group and loads its part of the model at once. Each rank past 0 then runs
``rank_group.follow`` in one long actor call: the steps reach it from rank 0 by a
broadcast, not by a Ray call per step.

Where rank 0 runs: a target's in the driver's process (both layouts); a draft's in its
``DraftActor`` (``draft_actor``), which starts its own ranks.

Faults: a rank's death takes its group down. Rank 0's collective with the dead rank fails
(the peer's socket closes) or times out (``tensor_parallel_timeout_s``), or its follow
call is seen ended before a step.

- Target: ``GroupCall`` answers ``WorkerLost`` (the engine requeues the group's sequences
  to recompute, as after a target actor's death), kills the ranks still up (none stays
  blocked on the dead one), and forms the group again on a thread of its own: new rank
  actors, rank 0's worker built anew over the new group. ``alive`` is True once that is
  done; after ``max_worker_restarts`` re-formings the group is gone.
- Draft: its ``DraftActor`` ends its own process; Ray restarts it as after any draft
  actor's death (its rank actors and their placement go with it: it owns them), and the
  new one forms a new group.
"""

from __future__ import annotations

import itertools
import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from datetime import timedelta

import ray

from specray.runtime.transport.actor_handle import WorkerActor
from specray.runtime.transport.target_actor import probs_values
from specray.runtime.transport.worker_call import WorkerLost
from specray.scheduler.config import CacheConfig
from specray.workers.config import ModelConfig

log = logging.getLogger(__name__)
_GROUP_IDS = itertools.count()


def _join(address: tuple[str, int], rank: int, size: int, device: str, timeout_s: float, field: str):
    """This process's rank of the group whose rendezvous is at ``address``."""
    import torch.distributed as dist

    from specray.workers.model_loader import resolve_device
    from specray.workers.tensor_parallel import RankGroup

    store = dist.TCPStore(address[0], address[1], is_master=False, timeout=timedelta(seconds=timeout_s))
    return RankGroup(store, rank, size, resolve_device(device), timeout_s, field)


def _worker_class(kind: str):
    if kind == "target":
        from specray.workers.target_worker import TargetWorker

        return TargetWorker
    from specray.workers.draft_worker import DraftWorker

    return DraftWorker


class _RankActor(WorkerActor):
    kind = ""

    def __init__(self, model: ModelConfig, cache: CacheConfig, address: tuple[str, int], rank: int, size: int,
                 timeout_s: float, field: str) -> None:
        super().__init__()
        self.group = _join(address, rank, size, model.device, timeout_s, field)
        self.worker = _worker_class(self.kind)(model, cache, group=self.group)

    def follow(self) -> int:
        from specray.workers.rank_group import follow

        try:
            return follow(self.worker, self.group)
        finally:
            self.group.close()


def _remove_groups_named(name: str) -> None:
    from ray.util.placement_group import PlacementGroup, placement_group_table, remove_placement_group

    for gid, g in placement_group_table().items():
        if g["name"] == name and g["state"] != "REMOVED":
            remove_placement_group(PlacementGroup(ray.PlacementGroupID(bytes.fromhex(gid))))


class TargetRankActor(_RankActor):
    """Rank ``rank`` (past 0) of a tensor-parallel target: joins the group, loads its part
    of the model, then follows rank 0's steps in ``follow``."""

    kind = "target"


class DraftRankActor(_RankActor):
    """Rank ``rank`` (past 0) of a tensor-parallel draft, as ``TargetRankActor``."""

    kind = "draft"


# Two calls at once: ``follow`` runs for the group's life, the driver's queries beside it.
RANK_ACTORS = {"target": ray.remote(max_concurrency=2)(TargetRankActor),
               "draft": ray.remote(max_concurrency=2)(DraftRankActor)}
FIELDS = {"target": "tensor_parallel_size", "draft": "draft_tensor_parallel_size"}


class RankSet:
    """One tensor-parallel worker (``kind`` "target" or "draft"): its rendezvous, its rank
    actors, and rank 0's worker in this process. ``opts``: what each rank actor asks Ray
    for (``actor_handle.actor_options``)."""

    def __init__(self, kind: str, model: ModelConfig, cache: CacheConfig, size: int, opts: dict,
                 timeout_s: float, placement_timeout_s: float, allocate: bool = True) -> None:
        self.kind, self.field = kind, FIELDS[kind]
        self.model, self.cache, self.size = model, cache, size
        self.opts = opts
        self.timeout_s, self.placement_timeout_s = timeout_s, placement_timeout_s
        self.actors: list = []
        self.follows: list = []
        self.pg = None
        self.store = None
        self.worker = None
        self.num_blocks: int | None = None     # once sized: a group formed again keeps it (the driver's mirror does)
        try:
            self.start(allocate)
        except BaseException:
            self.stop()
            raise

    def start(self, allocate: bool = True) -> None:
        """Rendezvous, placement, rank actors, and rank 0 here (``allocate=False``: its KV
        cache is sized later, ``ModelRunner.allocate``; the other ranks wait for it)."""
        import torch.distributed as dist
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from specray.runtime.driver.restarts import worker_group_name
        from specray.workers.model_loader import resolve_device
        from specray.workers.tensor_parallel import RankGroup

        here = ray.util.get_node_ip_address()
        self._check_node(here)
        timeout = timedelta(seconds=self.timeout_s)
        self.store = dist.TCPStore(here, 0, is_master=True, timeout=timeout, wait_for_workers=False)
        bundle = {"CPU": self.opts["num_cpus"], "GPU": self.opts["num_gpus"], **self.opts.get("resources", {})}
        bundle = {k: v for k, v in bundle.items() if v}
        # Every bundle must ask for something; the first pins the group to this node.
        bundles = [{**bundle, f"node:{here}": 0.001} if i == 0 else (bundle or {f"node:{here}": 0.001})
                   for i in range(self.size - 1)]
        # Named after the workers' group (the hosting actor's id), so that a restarted driver
        # removes it with theirs; a restarted draft actor (the same id, the count anew) first
        # removes what its predecessor left under the name.
        name = worker_group_name()
        name = f"{name}-tp{next(_GROUP_IDS)}" if name else ""
        if name:
            _remove_groups_named(name)
        self.pg = placement_group(bundles, strategy="STRICT_PACK", name=name)
        if not ray.get(self.pg.ready(), timeout=self.placement_timeout_s):
            raise RuntimeError(f"the cluster cannot place {self.size - 1} {self.kind} ranks {bundles} beside "
                               f"rank 0 within {self.placement_timeout_s:.0f}s")
        address = (here, self.store.port)
        cache = self.cache if self.num_blocks is None else replace(self.cache, num_kv_blocks=self.num_blocks)
        self.actors = [
            RANK_ACTORS[self.kind].options(
                **self.opts, max_restarts=0, max_task_retries=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=self.pg,
                                                                     placement_group_bundle_index=r - 1),
            ).remote(self.model, cache, address, r, self.size, self.timeout_s, self.field)
            for r in range(1, self.size)]
        group = RankGroup(self.store, 0, self.size, resolve_device(self.model.device), self.timeout_s, self.field)
        self.worker = _worker_class(self.kind)(self.model, cache, allocate=allocate, group=group)

    def _check_node(self, here: str) -> None:
        """More ranks than this node has devices for: refused, naming the setting."""
        node = next((n for n in ray.nodes() if n.get("Alive") and n.get("NodeManagerAddress") == here), None)
        if node is None:
            return
        have = node.get("Resources", {})
        for what, key in (("GPU", "num_gpus"), ("CPU", "num_cpus")):
            if self.opts[key] and self.size * self.opts[key] > have.get(what, 0):
                raise ValueError(f"{self.field}={self.size}: rank 0's node has {have.get(what, 0):g} {what}s, "
                                 f"its ranks ask for {self.size * self.opts[key]:g}")

    def follow(self) -> None:
        """The ranks past 0 start following (after rank 0's cache is allocated)."""
        self.follows = [a.follow.remote() for a in self.actors]

    def broken(self) -> bool:
        """A rank's follow call has ended: it died, or its group broke."""
        if not self.follows:
            return False
        done, _ = ray.wait(self.follows, num_returns=1, timeout=0)
        return bool(done)

    def stop(self) -> None:
        """Ranks killed (none waits on a dead peer), placement and rendezvous released."""
        from ray.util.placement_group import remove_placement_group

        w, self.worker = self.worker, None
        if w is not None and w.runner.kv is not None:
            self.num_blocks = w.num_blocks()
        if w is not None and w.share is not None and not w.share.group.broken and not self.broken():
            try:
                w.share.stop()
            except Exception:  # noqa: BLE001 - a peer already gone: the kills below end it
                pass
        if w is not None:
            w.runner.group.close()
        for a in self.actors:
            ray.kill(a, no_restart=True)
        self.actors, self.follows = [], []
        if self.pg is not None:
            remove_placement_group(self.pg)
            self.pg = None
        self.store = None

    def graph_stats(self, timeout_s: float) -> list[dict | None]:
        refs = [a.graph_stats.remote() for a in self.actors]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        return [ray.get(r) if r in ready else None for r in refs]


class GroupCall:
    """The engine's ``WorkerCall`` on a tensor-parallel target whose rank 0 runs here: it
    verifies in ``submit`` (``inline``), or, ``threaded``, on a thread of its own (so the
    data-parallel groups past the first verify beside it), and turns the group's loss
    into ``WorkerLost``."""

    def __init__(self, group: RankSet, max_restarts: int, threaded: bool = False) -> None:
        self.group = group
        self.max_restarts = max_restarts      # -1: formed again for ever
        self.losses = 0
        self._reform: threading.Thread | None = None
        self._reform_error: BaseException | None = None
        # One thread: the calls of two steps in flight run in the order submitted.
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="specray-tp-verify") if threaded else None
        self.inline = not threaded

    def submit(self, plan, probs):
        if self._thread is not None:
            return self._thread.submit(self._verify, plan, probs)
        return self._verify(plan, probs)

    def warm_up(self) -> None:
        """Nothing to open: rank 0 is in this process."""

    def _verify(self, plan, probs):
        if self._reform is not None:
            return WorkerLost("the tensor-parallel target is re-forming")
        g = self.group
        if g.broken():
            return self._lose("a rank of the tensor-parallel target ended")
        try:
            return g.worker.verify(plan, *probs_values(probs))
        except Exception as e:
            if not g.worker.runner.group.broken and not g.broken():
                raise                      # the plan's own failure: the group is still in step
            return self._lose(f"the tensor-parallel target lost a rank: {e}")

    def wait(self, handle):
        if isinstance(handle, Future):
            handle = handle.result()
        if isinstance(handle, WorkerLost):
            raise handle
        return handle

    def _lose(self, why: str) -> WorkerLost:
        self.losses += 1
        log.warning("specray: %s; forming the group again (%d)", why, self.losses)
        self._reform_error = None
        self._reform = threading.Thread(target=self._form_again, name="specray-tp-reform", daemon=True)
        self._reform.start()
        return WorkerLost(why)

    def _form_again(self) -> None:
        g = self.group
        try:
            g.stop()
            if not self.gone():
                g.start()
                g.follow()
        except BaseException as e:  # noqa: BLE001 - alive() reports it and the engine's timeout decides
            self._reform_error = e
            log.warning("specray: the tensor-parallel target did not form again: %s", e)

    def alive(self) -> bool:
        t = self._reform
        if t is None:
            return True
        if t.is_alive() or self.gone():
            return False
        if self._reform_error is not None:
            self._lose(f"forming the group again failed: {self._reform_error}")
            return False
        self._reform = None
        return True

    def gone(self) -> bool:
        return 0 <= self.max_restarts < self.losses

    def close(self) -> None:
        if self._thread is not None:
            self._thread.shutdown(wait=True)
        if self._reform is not None:
            self._reform.join(timeout=self.group.timeout_s)
        self.group.stop()
