"""Per-step time of one runtime layout against another, side by side in one run.

    python benchmarks/step_overhead.py [--target DIR --draft DIR] [--tokens 64] [--repeats 3]

Layouts: co-located (driver, draft and target in one actor), single node (driver, draft
and target actors on one node) with classic actor calls and with compiled graph
channels, and multi-node (a ray.cluster_utils.Cluster with the draft and the target on
their own nodes, both ways). Each reports, per step at batch 1: wall time, the draft and verify
workers' own compute, messaging (the rest of those calls), and the driver's own overhead
(scheduling, merge, update), medians over the repeats.
"""

from __future__ import annotations

import argparse
import json
import statistics



def measure(cfg_kwargs: dict, prompts: list[str], tokens: int, repeats: int) -> dict:
    from specray import RuntimeConfig, SamplingParams, SpecRuntime

    rt = SpecRuntime(RuntimeConfig(**cfg_kwargs))
    try:
        rt.generate(prompts[:1], SamplingParams(max_tokens=8, temperature=0.0))   # warm-up
        rows = []
        for r in range(repeats):
            before = rt.metrics()
            rt.generate([prompts[r % len(prompts)]], SamplingParams(max_tokens=tokens, temperature=0.0))
            after = rt.metrics()
            steps = after["num_steps"] - before["num_steps"]
            per = {k: (after[k] - before[k]) / steps * 1e3 for k in
                   ("busy_s", "draft_compute_s", "verify_compute_s", "messaging_s", "schedule_s", "merge_s",
                    "driver_overhead_s")}
            per["tokens_per_step"] = (after["num_emitted_tokens"] - before["num_emitted_tokens"]) / steps
            rows.append(per)
        return {k: statistics.median(row[k] for row in rows) for k in rows[0]}
    finally:
        rt.shutdown()


def main() -> None:
    import ray
    from ray.cluster_utils import Cluster

    from specray.runtime.cli_args import builtin_model
    from specray.runtime.stdlib_corpus import held_out_prompts

    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default=builtin_model("tiny-target"))
    ap.add_argument("--draft", default=builtin_model("tiny-draft"))
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("-k", type=int, default=4)
    args = ap.parse_args()
    prompts = held_out_prompts(args.repeats)
    base = dict(target=args.target, draft=args.draft, num_speculative_tokens=args.k, device="cpu", dtype="float32")
    results = {}
    ray.init(address="local", include_dashboard=False, log_to_driver=False)
    results["co-located"] = measure({**base, "colocate": True}, prompts, args.tokens, args.repeats)
    results["single node"] = measure(base, prompts, args.tokens, args.repeats)
    results["compiled"] = measure({**base, "compiled_graph": True}, prompts, args.tokens, args.repeats)
    ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    for kind in ("draft", "target"):
        cluster.add_node(num_cpus=0, resources={f"specray_{kind}": 1})
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    try:
        placed = {**base, "draft_resources": {"specray_draft": 1}, "target_resources": {"specray_target": 1}}
        results["multi-node"] = measure(placed, prompts, args.tokens, args.repeats)
        results["multi compiled"] = measure({**placed, "compiled_graph": True}, prompts, args.tokens, args.repeats)
    finally:
        ray.shutdown()
        cluster.shutdown()
    cols = ("busy_s", "draft_compute_s", "verify_compute_s", "messaging_s", "schedule_s", "merge_s", "driver_overhead_s")
    print(f"{'layout':14} " + " ".join(f"{c[:-2]:>16}" for c in cols) + f" {'tok/step':>9}   (ms per step)")
    for name, r in results.items():
        print(f"{name:14} " + " ".join(f"{r[c]:16.3f}" for c in cols) + f" {r['tokens_per_step']:9.2f}")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
