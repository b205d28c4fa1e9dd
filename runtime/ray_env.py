"""Which Ray to use: the rule of ``RuntimeConfig.ray_address``, and ownership of a
private local Ray shared by the runtimes of this process.

Joining a cluster never waits unbounded: ``ray.init`` on an address where no cluster
answers retries inside Ray's C++ client for minutes and does not return to Python (not
even for SIGTERM). So the address is resolved and its GCS port probed first, for at most
``timeout_s``; an address that does not answer is a ``ValueError`` naming ``ray_address``.
"""

from __future__ import annotations

import os
import socket
import threading
import time

import ray

LOCAL_OBJECT_STORE_BYTES = 512 * 1024 * 1024

_lock = threading.Lock()
_private_users = 0   # runtimes using the private Ray this module started


def resolve(address: str) -> str:
    """The ``host:port`` (or ``ray://host:port``) to join for a user's address.

    "auto" is the one Ray cluster running on this machine; with none, or with several
    (Ray itself would pick one of them silently), a ValueError lists what it found."""
    if address != "auto":
        return address
    from ray._private.services import find_gcs_addresses

    found = sorted(find_gcs_addresses())
    if not found:
        raise ValueError("ray_address='auto': no Ray cluster runs on this machine; start one with "
                         "`ray start --head`, or give its address (host:port)")
    if len(found) > 1:
        raise ValueError(f"ray_address='auto': {len(found)} Ray clusters run on this machine "
                         f"({', '.join(found)}); give the one to join as ray_address (or RAY_ADDRESS)")
    return found[0]


def wait_reachable(address: str, timeout_s: float) -> None:
    """Return once the cluster's GCS port accepts a TCP connection; ValueError after
    ``timeout_s`` (a cluster still starting gets until then)."""
    host, port = _host_port(address)
    deadline = time.monotonic() + timeout_s
    last: OSError | None = None
    while True:
        left = deadline - time.monotonic()
        try:
            with socket.create_connection((host, port), timeout=max(0.1, min(2.0, left))):
                return
        except OSError as e:
            last = e
        if time.monotonic() >= deadline:
            break
        time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))
    raise ValueError(f"ray_address {address!r}: no Ray cluster answers at {host}:{port} within {timeout_s:g} s "
                     f"({last.strerror or last if last else 'timed out'}); is it running, and is this the head's "
                     "GCS address (`ray start --head` prints it; default port 6379)?")


def _host_port(address: str) -> tuple[str, int]:
    rest = address.split("://", 1)[1] if "://" in address else address
    host, sep, port = rest.rstrip("/").rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"ray_address {address!r} is not host:port (or 'auto')")
    return host.strip("[]"), int(port)


def join(address: str, namespace: str | None, timeout_s: float) -> None:
    """``ray.init`` on a cluster, after a bounded check that it answers."""
    if address.startswith("http://") or address.startswith("https://"):
        raise ValueError(f"ray_address {address!r} is a dashboard URL (for `ray job submit`); give the GCS "
                         "address host:port")
    if address == "local":
        ray.init(address="local", namespace=namespace, log_to_driver=False)
        return
    address = resolve(address)
    wait_reachable(address, timeout_s)
    ray.init(address=address, namespace=namespace, log_to_driver=False)


def acquire(address: str | None, namespace: str | None, timeout_s: float) -> bool:
    """Initialise Ray unless it already is. Returns True when the caller uses the private
    local Ray started here and must ``release()`` it.

    None: reuse this process's Ray, else join ``RAY_ADDRESS`` (as inside ``ray job
    submit``), else start a private local Ray and never attach to some other cluster
    that happens to run on this machine. "auto": join the one cluster running on this
    machine. Anything else: the address of the cluster to join.
    """
    global _private_users
    with _lock:
        if ray.is_initialized():
            if _private_users:
                _private_users += 1
                return True
            return False
        if address is None:
            env = os.environ.get("RAY_ADDRESS")
            if env:
                join(env, namespace, timeout_s)
                return False
            store = int(os.environ.get("SPECRAY_OBJECT_STORE_BYTES", LOCAL_OBJECT_STORE_BYTES))
            ray.init(address="local", namespace=namespace, include_dashboard=False,
                     object_store_memory=store, log_to_driver=False)
            _private_users = 1
            return True
        join(address, namespace, timeout_s)
        return False


def release() -> None:
    """One user of the private Ray is done; the last one shuts it down."""
    global _private_users
    with _lock:
        _private_users -= 1
        if _private_users == 0 and ray.is_initialized():
            ray.shutdown()
