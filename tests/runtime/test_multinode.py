"""Draft and target pools on a multi-node cluster (ray.cluster_utils.Cluster): placement
on the right nodes, proposals merged across nodes, data-parallel targets, same output."""

from __future__ import annotations

import pytest
import ray
import torch
from ray._private.state import actors
from ray.cluster_utils import Cluster
from specray_testing import hf_greedy

from specray import RuntimeConfig, SamplingParams, SpecRuntime

MAX_LEN = 48
CLUSTER_REF: dict = {}


@pytest.fixture(scope="module")
def cluster():
    if ray.is_initialized():
        ray.shutdown()   # this module needs its own cluster; the next ray_session user restarts the local one
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "object_store_memory": 80 * 1024 * 1024,
                                                          "include_dashboard": False})
    nodes = {"draft": [], "target": []}
    # One target worker a target node: the driver's actor hosts the first (actor layout).
    for kind, amount in (("draft", 1), ("draft", 1), ("target", 1)):
        node = c.add_node(num_cpus=0, resources={f"specray_{kind}": amount}, object_store_memory=80 * 1024 * 1024)
        nodes[kind].append(node.node_id)
    c.wait_for_nodes()
    CLUSTER_REF["cluster"] = c
    CLUSTER_REF["target_nodes"] = nodes["target"]
    ray.init(address=c.address, log_to_driver=False)
    yield nodes
    ray.shutdown()
    c.shutdown()


def prompts():
    # Long prompts leave less room than k below MAX_LEN: merged batches mix proposal lengths.
    return [torch.randint(0, 97, (n,), generator=torch.Generator().manual_seed(n)).tolist()
            for n in (2, 5, 9, 14, 20, 30, 38, 41)]


def placement(cls: str) -> list[str]:
    # From the GCS's actor table: the state API would need the head's dashboard, which on a
    # loaded machine came up later than its client's retries.
    return [a["Address"]["NodeID"] for a in actors().values() if a["ActorClassName"] == cls and a["State"] == "ALIVE"]


def generate(cfg: RuntimeConfig):
    rt = SpecRuntime(cfg)
    try:
        outs = rt.generate(prompts(), SamplingParams(max_tokens=20, temperature=0.0))
        driver = placement("Driver")
        assert len(driver) == 1 and driver[0] in CLUSTER_REF["target_nodes"]   # ... on a target node
        return outs, rt.metrics(), placement("DraftActor"), placement("TargetActor")
    finally:
        rt.shutdown()


def config(t, d, **kw):
    return RuntimeConfig(target=t, draft=d, num_speculative_tokens=4, block_size=4, device="cpu", dtype="float32",
                         max_model_len=MAX_LEN, draft_resources={"specray_draft": 1},
                         target_resources={"specray_target": 1}, **kw)


def test_two_draft_nodes_and_a_target_node(cluster, llama_pair):
    t, d = llama_pair
    outs, m, drafts, targets = generate(config(t, d, num_draft_workers=2))
    assert sorted(drafts) == sorted(cluster["draft"])          # one per draft node
    assert targets == []                                       # the target lives in the driver's actor ...
    assert m["layout"] == "actors" and m["num_group_steps"] > 0
    expected = [e[:MAX_LEN - len(p)] for p, e in zip(prompts(), hf_greedy(t, prompts(), 20))]
    assert [o.token_ids for o in outs] == expected
    assert m["num_draft_workers"] == 2 and m["num_draft_tokens"] > 0
    # Sequences near max_model_len proposed fewer than k tokens or none.
    assert outs[-1].num_draft_tokens < 4 * len(outs[-1].token_ids)


def test_unplaceable_workers_fail_clearly(cluster, llama_pair):
    t, d = llama_pair
    cfg = config(t, d, num_draft_workers=3, placement_strategy="STRICT_SPREAD", placement_timeout_s=3)
    with pytest.raises(Exception, match="cannot place"):
        SpecRuntime(cfg)


def run_and_remove_node_midway(rt: SpecRuntime, node) -> tuple[list, list[int]]:
    """Stream one request and, once it yields, start the rest and remove ``node``."""
    import threading

    outs: list = []
    worker = threading.Thread(target=lambda: outs.extend(
        rt.generate(prompts(), SamplingParams(max_tokens=20, temperature=0.0))))
    streamed: list[int] = []
    for delta in rt.stream(prompts()[0], SamplingParams(max_tokens=40, temperature=0.0)):
        if not streamed and delta.token_ids:
            worker.start()
            CLUSTER_REF["cluster"].remove_node(node)
        streamed += delta.token_ids
    worker.join(timeout=300)
    return outs, streamed


def test_losing_a_target_node_mid_run_changes_no_output(cluster, llama_pair):
    """Two target workers on two nodes: the driver's actor hosting the first, an actor the
    second; the second's node goes away with sequences on it. They are requeued with their
    tokens and finish on the first: the lost worker has nowhere else to go (each target
    node offers one), so it stays down."""
    t, d = llama_pair
    c = CLUSTER_REF["cluster"]
    extra = c.add_node(num_cpus=0, resources={"specray_target": 1}, object_store_memory=80 * 1024 * 1024)
    c.wait_for_nodes()
    CLUSTER_REF["target_nodes"] = cluster["target"] + [extra.node_id]
    rt = SpecRuntime(config(t, d, num_draft_workers=2, num_target_workers=2, max_worker_restarts=1,
                            placement_strategy="STRICT_SPREAD"))
    try:
        (target_node,) = placement("TargetActor")
        (driver_node,) = placement("Driver")
        assert sorted([target_node, driver_node]) == sorted(cluster["target"] + [extra.node_id])
        victim = next(n for n in c.worker_nodes if n.node_id == target_node)
        # Before the loss: two data-parallel targets on two nodes give the plain greedy output.
        warm = rt.generate(prompts(), SamplingParams(max_tokens=20, temperature=0.0))
        expected = [e[:MAX_LEN - len(p)] for p, e in zip(prompts(), hf_greedy(t, prompts(), 20))]
        assert [o.token_ids for o in warm] == expected
        assert rt.metrics()["num_target_workers"] == 2
        outs, streamed = run_and_remove_node_midway(rt, victim)
        assert [o.token_ids for o in outs] == expected
        assert streamed == hf_greedy(t, [prompts()[0]], 40)[0]
        m = rt.metrics()
        assert m["num_target_worker_failures"] >= 1 and m["num_preemptions"] >= 1
        assert len(m["target_workers_down"]) == 1
    finally:
        rt.shutdown()


def test_losing_a_draft_node_mid_run_changes_no_output(cluster, llama_pair):
    """Runs last in this module: it removes a node of the shared cluster. The lost draft
    worker cannot come back (no other node offers specray_draft), so its sequences finish
    on the target alone and metrics() says the worker is down."""
    t, d = llama_pair
    rt = SpecRuntime(config(t, d, num_draft_workers=2, max_worker_restarts=1))
    try:
        nodes = {n.node_id: n for n in CLUSTER_REF["cluster"].worker_nodes}
        outs, streamed = run_and_remove_node_midway(rt, nodes[placement("DraftActor")[0]])
        expected = [e[:MAX_LEN - len(p)] for p, e in zip(prompts(), hf_greedy(t, prompts(), 20))]
        assert [o.token_ids for o in outs] == expected
        assert streamed == hf_greedy(t, [prompts()[0]], 40)[0]
        m = rt.metrics()
        assert m["num_draft_worker_failures"] >= 1
        assert len(m["draft_workers_down"]) == 1
    finally:
        rt.shutdown()
