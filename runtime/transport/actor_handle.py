"""The driver's side of a worker actor, whichever kind: its restarts, its liveness and its
link; and what every worker actor answers besides its step.

A worker actor is restarted by Ray when it dies (``max_restarts``); meanwhile ``wait``
raises ``WorkerLost`` and ``alive`` watches, without blocking, for it to answer again.
Step calls go on the actor's own
socket (``specray.runtime.transport.worker_link``), or as Ray actor calls where it has none.
Plans travel as msgpack bytes and are decoded without their cross-field checks: the
workers' entry points run those for every caller, once.
"""

from __future__ import annotations

import logging
import os
import threading
import time

from specray.runtime.transport.link_auth import LOOPBACK, link_hosts
from specray.runtime.transport.worker_call import WorkerLost
from specray.runtime.transport.worker_link import Link, LinkCall, LinkLost, LinkServer
from specray.scheduler.messages import StepPlan, encode
from specray.workers.errors import StaleCacheError

log = logging.getLogger(__name__)


class WorkerActor:
    """What the driver asks of either kind of worker actor besides its step, and its link.
    Each kind defines ``_call(op, data, arg, tensors) -> (message, tensor or None)``, which
    serves its Ray methods and its link alike, one call at a time (``_locked_call``)."""

    worker: object

    def __init__(self) -> None:
        # Calls arrive on Ray's thread and on the link's: one at a time reaches the worker.
        self._lock = threading.Lock()
        self._link: LinkServer | None = None

    def _locked_call(self, op: str, data: bytes | None, arg, tensors=()) -> tuple[bytes, object]:
        with self._lock:
            return reply(*self._call(op, data, arg, tensors))

    def open_link(self, driver_ip: str) -> tuple[tuple[str, int], bytes]:
        """The address and token of this actor's link (``worker_link``) for a driver on the
        node ``driver_ip``: bound to loopback when that is this actor's node, to the node's
        IP otherwise, and open to that driver's address only. Opened once, and again for a
        driver elsewhere."""
        import ray

        host, peer = link_hosts(ray.util.get_node_ip_address(), driver_ip)
        if self._link is None or (self._link.address[0], self._link.peer) != (host, peer):
            if self._link is not None:
                self._link.close()
            self._link = LinkServer(self._locked_call, host, peer)
        return self._link.address, self._link.token

    def num_blocks(self) -> int:
        return self.worker.num_blocks()

    def graph_stats(self) -> dict:
        return self.worker.graph_stats()

    def ready(self) -> bool:
        return True


def reply(message, probs) -> tuple[bytes, object]:
    """A step's answer off the actor: the message encoded, tensors on the host so any node
    can read them."""
    return encode(message), (probs.cpu() if probs is not None else None)


_tls_said = False


def ray_tls() -> bool:
    """Whether Ray runs with TLS in this process (``RAY_USE_TLS``, read as Ray reads it). The
    worker link is plaintext beside it, so then step calls stay on Ray; said once in the log."""
    global _tls_said
    on = os.environ.get("RAY_USE_TLS", "0").lower() in ("1", "true")
    if on and not _tls_said:
        _tls_said = True
        log.info("Ray runs with TLS (RAY_USE_TLS): worker links are off, step calls go as Ray actor calls")
    return on


def actor_options(resources: dict[str, float], gpu: bool) -> dict:
    """Exactly the configured resources (num_cpus 0 unless named), plus one GPU on CUDA."""
    res = dict(resources)
    opts = {"num_cpus": res.pop("CPU", 0), "num_gpus": res.pop("GPU", 1 if gpu else 0)}
    if res:
        opts["resources"] = res
    return opts


class ActorHandle:
    """A worker actor. When it dies Ray restarts it (``max_restarts``); meanwhile
    ``wait`` raises WorkerLost and ``alive`` watches, without blocking, for it to answer."""

    warm_up_args: tuple = ()

    def __init__(self, actor, max_restarts: int, link: bool = False) -> None:
        """``link``: step calls on the actor's own socket (``specray.runtime.transport.worker_link``)
        where it can be reached, Ray calls otherwise."""
        self.actor = actor
        self.link: Link | None = None
        self._link_wanted = link and not ray_tls()
        self._link_failed = False
        self.max_restarts = max_restarts   # -1: Ray restarts it forever
        self.losses = 0
        self._ready = None        # a ready() call in flight while the actor is lost
        self._asked = 0.0
        # call id -> (call, deaths counted when it was sent): two calls in flight when the
        # actor dies (groups in flight) are one death.
        self._sent: dict[int, tuple] = {}

    def _stamp(self, ref):
        """``ref``, remembered with the deaths counted so far (see ``_get``)."""
        self._sent[id(ref)] = (ref, self.losses)
        return ref

    def linked(self) -> bool:
        """Whether its steps go on its link now."""
        return self.link is not None and not self.link.closed

    def _linked(self) -> Link | None:
        """The actor's link, opened on first use and again after a restart; None where
        links are off or its address cannot be reached (then Ray calls, for good). Raises
        Ray's error when the actor is down: the call fails as a Ray call to it would."""
        if not self._link_wanted or self._link_failed:
            return None
        if self.link is None or self.link.closed:
            import ray

            here = ray.util.get_node_ip_address()
            address, token = ray.get(self.actor.open_link.remote(here))
            try:
                # From the node's IP, the one address the worker accepts (another interface
                # of a multi-homed node would be refused).
                self.link = Link(address, token, source=None if address[0] == LOOPBACK else here)
            except OSError as e:
                log.warning("worker link to %s:%s did not open, using Ray actor calls: %s", *address, e)
                self._link_failed = True
                return None
        return self.link

    def _send(self, op: str, data: bytes | None = None, arg=None, tensors=()):
        """A link call, or None (no link: use a Ray call), or the error that stopped it
        (``wait`` raises it as the call's)."""
        try:
            link = self._linked()
            return link.send(op, data, arg, tensors) if link is not None else None
        except Exception as e:   # noqa: BLE001 - the actor is down or the link broke: ``_get`` sorts it out
            return e

    def warm_up(self) -> None:
        """Open the link and run an empty step through it: startup pays for the
        connection and the handshake, not a request's first step."""
        if self._link_wanted:
            self.wait(self.submit(StepPlan(), *self.warm_up_args))

    def close(self) -> None:
        if self.link is not None:
            self.link.close()

    def _get(self, ref):
        import ray

        try:
            if isinstance(ref, BaseException):
                raise ref
            if isinstance(ref, LinkCall):
                got = ref.result()
            else:
                got = ray.get(ref)
            self._sent.pop(id(ref), None)
            return got
        except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError, LinkLost) as e:
            if isinstance(e, ray.exceptions.RayTaskError) and not isinstance(e.cause, StaleCacheError):
                raise
            # A lost call or an empty restarted worker: either way one death (a worker
            # that is down gets no calls, and a call sent before a death already counted
            # is that death). Its link is closed with it; a new one opens once it
            # answers again.
            sent = self._sent.pop(id(ref), (None, self.losses))[1]
            if sent < self.losses:
                raise WorkerLost(str(e)) from None
            self.losses += 1
            if self.link is not None:
                self.link.close()
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
