"""Which Ray to use: the rule of ``RuntimeConfig.ray_address``, and ownership of a
private local Ray shared by the runtimes of this process."""

from __future__ import annotations

import os
import threading

import ray

LOCAL_OBJECT_STORE_BYTES = 512 * 1024 * 1024

_lock = threading.Lock()
_private_users = 0   # runtimes using the private Ray this module started


def acquire(address: str | None, namespace: str | None = None) -> bool:
    """Initialise Ray unless it already is. Returns True when the caller uses the private
    local Ray started here and must ``release()`` it.

    None: reuse this process's Ray, else join ``RAY_ADDRESS`` (as inside ``ray job
    submit``), else start a private local Ray and never attach to some other cluster
    that happens to run on this machine. "auto": join a running cluster on this machine.
    Anything else: the address of the cluster to join.
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
                ray.init(address=env, namespace=namespace, log_to_driver=False)
                return False
            store = int(os.environ.get("SPECRAY_OBJECT_STORE_BYTES", LOCAL_OBJECT_STORE_BYTES))
            ray.init(address="local", namespace=namespace, include_dashboard=False,
                     object_store_memory=store, log_to_driver=False)
            _private_users = 1
            return True
        ray.init(address=address, namespace=namespace, log_to_driver=False)
        return False


def release() -> None:
    """One user of the private Ray is done; the last one shuts it down."""
    global _private_users
    with _lock:
        _private_users -= 1
        if _private_users == 0 and ray.is_initialized():
            ray.shutdown()
