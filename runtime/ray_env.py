"""Which Ray to use: the rule of ``RuntimeConfig.ray_address``."""

from __future__ import annotations

import os

import ray

LOCAL_OBJECT_STORE_BYTES = 512 * 1024 * 1024


def ensure_ray(address: str | None, namespace: str | None = None) -> bool:
    """Initialise Ray unless it already is; returns True when this call started a
    private local Ray (which the caller then owns and shuts down).

    None: reuse this process's Ray, else join ``RAY_ADDRESS`` (as inside ``ray job
    submit``), else start a private local Ray and never attach to some other cluster
    that happens to run on this machine. "auto": join a running cluster on this machine.
    Anything else: the address of the cluster to join.
    """
    if ray.is_initialized():
        return False
    if address is None:
        env = os.environ.get("RAY_ADDRESS")
        if env:
            ray.init(address=env, namespace=namespace, log_to_driver=False)
            return False
        store = int(os.environ.get("SPECRAY_OBJECT_STORE_BYTES", LOCAL_OBJECT_STORE_BYTES))
        ray.init(address="local", namespace=namespace, include_dashboard=False,
                 object_store_memory=store, log_to_driver=False)
        return True
    ray.init(address=address, namespace=namespace, log_to_driver=False)
    return False
