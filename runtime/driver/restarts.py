"""The driver actor's restarts: how it is created to be restarted, how a client rides one
out, and the log ``metrics()`` reads (``num_driver_restarts``, ``driver_recovery_s``).

Ray restarts the driver actor (``max_restarts=ClusterConfig.max_driver_restarts``) when
its process dies: SIGKILL, the OOM killer, a lost node. Its constructor runs again with
the same configuration. What happens, checked on Ray 2.60:

- every actor the old process created (the workers) dies with it: they fate-share with
  their owner. The new driver starts new workers.
- its placement group is removed with it only where the driver is detached; one made by
  an actor that is not detached lives as long as the job (the client process that created
  the driver), so it would hold the dead driver's resources (its GPUs) while the new driver
  asks for the same again. The workers' placement group is therefore named after the
  driver actor (``worker_group_name``), and a restarted driver removes the groups of that
  name its predecessors left (``remove_stale_groups``) before it starts its own.
- calls in flight when it died fail (``ActorUnavailableError`` in the process that created
  it, ``ActorDiedError`` in others); calls made while it restarts wait for the new
  constructor in the creator's process, and may fail at once in others: whether it is
  dead for good is asked of the GCS actor table (``died_for_good``), never guessed from
  the error. A named actor keeps its name, so ``ray.get_actor`` finds it again; once
  ``max_restarts`` is spent its state is DEAD.

The log lives in Ray's GCS key-value store (``internal_kv``), under the actor's id: the
one store that outlives the actor's process. It survives what the GCS survives (not a
head loss without GCS fault tolerance); losing it loses the figures, not a request.
"""

from __future__ import annotations

import json
import time

DRIVER_RESTART_TIMEOUT_S = 300.0     # a client waits this long for a restarted driver


class DriverGone(RuntimeError):
    """The driver actor died and did not come back (``max_driver_restarts`` spent, or it
    did not answer within the client's restart timeout). Its requests are lost."""


def actor_errors() -> tuple[type, ...]:
    """What a call raises when the driver's process died under it or is restarting."""
    from ray import exceptions as rex

    return tuple(getattr(rex, n) for n in ("RayActorError", "ActorUnavailableError", "ActorDiedError")
                 if hasattr(rex, n))


def died_for_good(driver, e: BaseException) -> bool:
    """The driver actor is dead and Ray will not restart it again. Asked of the GCS's actor
    table: the error alone does not tell (a process that did not create the actor sees
    ``ActorDiedError`` for calls made while it restarts, too)."""
    try:
        from ray._private.state import actors

        return actors(driver._actor_id.hex())["State"] == "DEAD"
    except Exception:  # noqa: BLE001 - no table to ask: the error's kind is the best guess
        from ray import exceptions as rex

        return isinstance(e, getattr(rex, "ActorDiedError", ())) and not isinstance(
            e, getattr(rex, "ActorUnavailableError", ()))


def wait_for_driver(driver, deadline: float, why: str) -> None:
    """Block until the driver answers again (Ray restarted it), or raise ``DriverGone``
    saying what happened: ``why`` is the failure that sent the caller here."""
    import ray

    errors = actor_errors() + (ray.exceptions.GetTimeoutError,)
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise DriverGone(f"the specray driver failed ({why}) and did not answer again within the restart "
                             "timeout; its requests are lost")
        try:
            info = ray.get(driver.info.remote(), timeout=min(left, 30.0))
        except errors as e:
            if died_for_good(driver, e):
                raise DriverGone(f"the specray driver died and Ray will not restart it again ({why}; then "
                                 f"{type(e).__name__}); its requests are lost") from None
            time.sleep(0.2)
            continue
        if isinstance(info, str):
            raise DriverGone(f"the restarted specray driver refused its configuration: {info}")
        return


def worker_group_name() -> str:
    """The name of the workers' placement group: the driver actor's id, where this runs in
    one (the empty name, Ray's default, elsewhere)."""
    try:
        import ray

        actor = ray.get_runtime_context().get_actor_id()
    except Exception:  # noqa: BLE001 - not inside Ray: no name
        return ""
    return f"specray-workers-{actor}" if actor else ""


def remove_stale_groups() -> int:
    """Remove the placement groups earlier incarnations of this driver actor left; returns
    how many. Called by a restarted driver before it starts its workers."""
    import ray
    from ray.util.placement_group import PlacementGroup, placement_group_table, remove_placement_group

    name = worker_group_name()
    if not name:
        return 0
    # The workers' group, and the tensor-parallel ranks' groups named after it (``name-tp<i>``).
    stale = [gid for gid, g in placement_group_table().items()
             if (g["name"] == name or g["name"].startswith(name + "-tp")) and g["state"] != "REMOVED"]
    for gid in stale:
        remove_placement_group(PlacementGroup(ray.PlacementGroupID(bytes.fromhex(gid))))
    return len(stale)


class RestartLog:
    """One driver actor's restarts, kept in the GCS under its actor id. A process that is
    not a restarted actor (the first start, or no Ray actor at all) records nothing and
    reads nothing: the GCS is touched once per restart, never per step or per metrics call."""

    def __init__(self) -> None:
        self.started = time.monotonic()
        self.key: bytes | None = None
        self.entries: list[dict] = []         # the restarts that got to run this constructor, this one last
        self.num_restarts = 0                 # Ray's count: also those killed before they got here
        self._first_token_seen = True
        try:
            import ray

            ctx = ray.get_runtime_context()
            actor = ctx.get_actor_id()
            reconstructed = actor is not None and ctx.was_current_actor_reconstructed
        except Exception:  # noqa: BLE001 - not inside an actor: no log
            return
        if actor is None:
            return
        self.key = f"specray/driver_restarts/{actor}".encode()
        if reconstructed:
            self._safe(remove_stale_groups)
            self.entries = (self._safe(self._read) or []) + [{"at": time.time(), "ready_s": None,
                                                               "first_token_s": None}]
            self._first_token_seen = False
            self._safe(self._write)
            self.num_restarts = self._safe(lambda: _ray_restart_count(actor)) or len(self.entries)

    def _read(self) -> list[dict]:
        from ray.experimental import internal_kv

        raw = internal_kv._internal_kv_get(self.key)
        return json.loads(raw) if raw else []

    def _write(self) -> None:
        from ray.experimental import internal_kv

        internal_kv._internal_kv_put(self.key, json.dumps(self.entries).encode(), overwrite=True)

    def ready(self) -> None:
        """The restarted driver's workers are up: it serves again."""
        if not self._first_token_seen:
            self.entries[-1]["ready_s"] = round(time.monotonic() - self.started, 3)
            self._safe(self._write)

    def first_token(self) -> None:
        """A step emitted tokens for the first time since the restart (called each step:
        a bool test once done)."""
        if self._first_token_seen:
            return
        self._first_token_seen = True
        self.entries[-1]["first_token_s"] = round(time.monotonic() - self.started, 3)
        self._safe(self._write)

    def metrics(self) -> dict:
        return {"num_driver_restarts": self.num_restarts,
                "driver_recovery_s": [e["ready_s"] for e in self.entries],
                "driver_first_token_s": [e["first_token_s"] for e in self.entries]}

    def clear(self) -> None:
        """The driver is shut down on purpose: its log goes with it."""
        if self.key is not None:
            from ray.experimental import internal_kv

            self._safe(lambda: internal_kv._internal_kv_del(self.key))

    @staticmethod
    def _safe(fn):
        try:
            return fn()
        except Exception:  # noqa: BLE001 - figures must not stop the serving
            return None


def _ray_restart_count(actor_id: str) -> int:
    from ray._private.state import actors

    return int(actors(actor_id)["NumRestarts"])
