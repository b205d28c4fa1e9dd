"""Where the workers run (``RuntimeConfig.layout``), and what follows from it, decided once.

- ``"colocated"``: driver, draft and target in one actor: no hop per step, the two models
  take turns on the same cores or device.
- ``"actors"``: the driver's actor hosts the target worker and asks for the target's
  resources, so on a cluster it lands where the target's device is; the draft workers are
  actors of their own. A step has one remote hop, to the draft; further target workers
  (data parallel) are actors called while the hosted one verifies.
- ``"auto"``: co-located where draft and target would share one device or one machine's
  CPUs and nothing asks for separate resources; actors otherwise.

``choose`` decides the layout from plain facts (testable without Ray); ``resolve`` reads
them from the Ray this process is connected to and logs the one line that says which and
why (the client does this before it starts the driver). What follows from the decided
layout is decided once, by the driver (``specray.runtime.settled``).
"""

from __future__ import annotations

import logging

from specray.runtime.config import RuntimeConfig

log = logging.getLogger("specray")


def choose(config: RuntimeConfig, num_nodes: int, num_gpus: float) -> tuple[str, str]:
    """(layout, why) for ``config`` on a cluster of ``num_nodes`` alive nodes holding
    ``num_gpus`` GPUs in all."""
    cluster = config.cluster
    if cluster.layout != "auto":
        return cluster.layout, "asked for"
    dtp = cluster.draft_tensor_parallel_size
    if dtp > 1:
        return "actors", f"draft_tensor_parallel_size={dtp}: the draft's ranks are actors"
    asks = [name for name in ("draft_resources", "target_resources") if getattr(cluster, name)]
    if asks:
        return "actors", f"{' and '.join(asks)} ask for separate resources"
    if not config.speculation.draft_model:
        return "colocated", f"proposer {config.speculation.proposer!r} has no draft model to separate"
    workers = cluster.num_draft_workers + cluster.num_target_workers
    if num_nodes > 1 and workers > 2:
        return "actors", f"{workers} workers on a cluster of {num_nodes} nodes"
    device = config.model.device
    gpu = device == "cuda" or (device == "auto" and num_gpus > 0)
    if gpu:
        if num_gpus >= 2:
            return "actors", f"{num_gpus:g} GPUs: draft and target each get one"
        return "colocated", "draft and target would share the one GPU"
    if num_nodes > 1:
        return "actors", f"{num_nodes} nodes: draft and target get CPUs of their own"
    return "colocated", "draft and target would share one machine's CPUs"


def resolve(config: RuntimeConfig) -> RuntimeConfig:
    """``config`` with ``layout`` decided (never "auto"), the decision logged."""
    import ray

    nodes = [n for n in ray.nodes() if n.get("Alive")]
    gpus = ray.cluster_resources().get("GPU", 0)
    layout, why = choose(config, len(nodes), gpus)
    log.info("specray layout: %s (%s)", layout, why)
    return config if layout == config.cluster.layout else config.replace(layout=layout)

