"""Per-step time of one runtime layout against another, side by side in one run.

    python benchmarks/step_overhead.py [--target DIR --draft DIR] [--tokens 64] [--repeats 3]
                                       [--batch-sizes 1,8,32] [--layouts co-located,single node]

Layouts: co-located (driver, draft and target in one actor), single node (the actor
layout: the driver's actor hosting the target, a draft actor beside it, on one node) with
two groups in flight (the default), one group, the draft reached over Ray actor calls
instead of its link; two target workers (data parallel: one
hosted, one an actor), over links or Ray calls; and multi-node (a ray.cluster_utils.Cluster with the draft and the
target on
their own nodes, both ways). Each reports, per step and batch size: wall time, the draft
and verify workers' own compute, messaging (the rest of those calls: the hops), and the
driver's own overhead (scheduling, merge, update), medians over the repeats.
"""

from __future__ import annotations

import argparse
import json
import statistics

COLS = ("busy_s", "draft_compute_s", "verify_compute_s", "messaging_s", "schedule_s", "merge_s", "driver_overhead_s")
SINGLE = ("co-located", "single node", "single node ray calls", "single node 1 group", "2 targets",
          "2 targets ray calls")
MULTI = ("multi-node",)


def measure(cfg_kwargs: dict, prompts: list[str], tokens: int, repeats: int, batch: int) -> dict:
    from specray import RuntimeConfig, SamplingParams, SpecRuntime

    rt = SpecRuntime(RuntimeConfig(**cfg_kwargs))
    try:
        rt.generate(prompts[:1], SamplingParams(max_tokens=8, temperature=0.0))   # warm-up
        rows = []
        for r in range(repeats):
            before = rt.metrics()
            batch_prompts = [prompts[(r * batch + i) % len(prompts)] for i in range(batch)]
            rt.generate(batch_prompts, SamplingParams(max_tokens=tokens, temperature=0.0))
            after = rt.metrics()
            steps = after["num_steps"] - before["num_steps"]
            per = {k: (after[k] - before[k]) / steps * 1e3 for k in COLS}
            per["tokens_per_step"] = (after["num_emitted_tokens"] - before["num_emitted_tokens"]) / steps
            rows.append(per)
        return {k: statistics.median(row[k] for row in rows) for k in rows[0]}
    finally:
        rt.shutdown()


def main() -> None:
    import ray
    from ray.cluster_utils import Cluster

    from specray.runtime.bench.stdlib_corpus import held_out_prompts
    from specray.runtime.model_store import builtin_model

    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default=builtin_model("tiny-target"))
    ap.add_argument("--draft", default=builtin_model("tiny-draft"))
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batch-sizes", default="1")
    ap.add_argument("--layouts", default=",".join(SINGLE + MULTI),
                    help="comma-separated, of: " + ", ".join(SINGLE + MULTI))
    ap.add_argument("-k", type=int, default=4)
    args = ap.parse_args()
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    layouts = [x.strip() for x in args.layouts.split(",")]
    prompts = held_out_prompts(max(args.repeats * max(sizes), args.repeats))
    base = dict(target=args.target, draft=args.draft, num_speculative_tokens=args.k, device="cpu", dtype="float32",
                max_num_seqs=max(sizes))
    kinds = {"co-located": {"layout": "colocated"}, "single node": {"layout": "actors"},
             "single node ray calls": {"layout": "actors", "worker_link": False},
             "single node 1 group": {"layout": "actors", "groups_in_flight": 1},
             "2 targets": {"layout": "actors", "num_target_workers": 2},
             "2 targets ray calls": {"layout": "actors", "num_target_workers": 2, "worker_link": False}}
    results = {}
    if any(x in SINGLE for x in layouts):
        ray.init(address="local", include_dashboard=False, log_to_driver=False)
        for name in (x for x in layouts if x in SINGLE):
            for b in sizes:
                results[f"{name} b{b}"] = measure({**base, **kinds[name]}, prompts, args.tokens, args.repeats, b)
        ray.shutdown()
    if any(x in MULTI for x in layouts):
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
        for kind in ("draft", "target"):
            cluster.add_node(num_cpus=0, resources={f"specray_{kind}": 1})
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False)
        try:
            placed = {**base, "draft_resources": {"specray_draft": 1}, "target_resources": {"specray_target": 1}}
            for b in sizes:
                results[f"multi-node b{b}"] = measure(placed, prompts, args.tokens, args.repeats, b)
        finally:
            ray.shutdown()
            cluster.shutdown()
    print(f"{'layout':18} " + " ".join(f"{c[:-2]:>16}" for c in COLS) + f" {'tok/step':>9}   (ms per step)")
    for name, r in results.items():
        print(f"{name:18} " + " ".join(f"{r[c]:16.3f}" for c in COLS) + f" {r['tokens_per_step']:9.2f}")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
