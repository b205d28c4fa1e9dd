"""The device check to run when a GPU machine is at hand: exactness, then speed, on it.

    python benchmarks/gpu_check.py [--device cuda] [--tokens 64] [--bench-tokens 64] [--bench-repeats 3]

1. Greedy exactness on the device: the built-in pair's greedy output through every
   runtime layout (co-located, worker actors, compiled graph channels; draft, n-gram and
   no proposer; CUDA graphs on, and off co-located) must equal transformers' own greedy
   ``generate`` on the same device and dtype, token for token.
2. ``benchmarks/executor_forward.py --graphs``: per-forward time of the native executor
   eager, replayed as CUDA graphs, and the transformers path, at batch 1, 8 and 32.
3. ``specray bench`` (co-located) on the device, tables printed.

Exits 1 on any mismatch. Everything runs on one private local Ray.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path



def main() -> int:
    import ray

    from specray import RuntimeConfig, SamplingParams, SpecRuntime
    from specray.runtime.bench.hf_runner import HFRunner
    from specray.runtime.bench.report import format_table
    from specray.runtime.bench.run import run_bench
    from specray.runtime.bench.settings import BenchSettings
    from specray.runtime.cli_args import builtin_model
    from specray.runtime.stdlib_corpus import held_out_prompts
    from specray.workers.model_loader import load_tokenizer

    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--bench-tokens", type=int, default=64)
    ap.add_argument("--bench-repeats", type=int, default=3)
    ap.add_argument("--batch-sizes", default="1,8,32")
    args = ap.parse_args()
    target, draft = builtin_model("tiny-target"), builtin_model("tiny-draft")
    hf = HFRunner(BenchSettings(target=target, draft=draft, device=args.device))
    print(f"device {hf.device}, dtype {hf.target.dtype}", flush=True)

    tok = load_tokenizer(target)
    prompts = [tok(t, add_special_tokens=False)["input_ids"] for t in held_out_prompts(8)]
    # The reference: transformers' greedy generate, one prompt at a time (no padding).
    expected = [hf.generate([p], args.tokens, False, 0.0, 0)[0][0] for p in prompts]
    del hf
    ray.init(address="local", include_dashboard=False, log_to_driver=False)
    failures = []
    # Draft and target workers each ask for a whole GPU by default: half each fits one GPU.
    half = {"target_resources": {"GPU": 0.5}, "draft_resources": {"GPU": 0.5}} if args.device != "cpu" else {}
    half["placement_timeout_s"] = 60
    layouts = {"co-located": {"colocate": True}, "co-located eager": {"colocate": True, "cuda_graphs": False},
               "actors": half, "compiled graph": {"compiled_graph": True, **half}}
    for name, layout in layouts.items():
        for proposer in ("draft", "ngram", "none"):
            cfg = RuntimeConfig(target=target, draft=draft if proposer == "draft" else None, proposer=proposer,
                                device=args.device, **layout)
            rt = SpecRuntime(cfg)
            try:
                t0 = time.perf_counter()
                outs = rt.generate(prompts, SamplingParams(max_tokens=args.tokens, temperature=0.0))
                dt = time.perf_counter() - t0
                got = [o.token_ids for o in outs]
                ok = got == expected
                m = rt.metrics()
                print(f"{name:15} {proposer:6} exact={ok} tokens/s={sum(map(len, got)) / dt:8.1f} "
                      f"acceptance={m['acceptance_rate']:.3f} overhead/step={m['mean_overhead_s'] * 1e3:.3f} ms",
                      flush=True)
                if not ok:
                    failures.append(f"{name}/{proposer}")
            finally:
                rt.shutdown()
    ray.shutdown()

    print("\nper forward, native eager / CUDA graphs / transformers:", flush=True)
    subprocess.run([sys.executable, str(Path(__file__).with_name("executor_forward.py")), "--device", args.device,
                    "--batch-sizes", args.batch_sizes, "--repeats", "100", "--graphs"], check=False)

    sizes = tuple(int(x) for x in args.batch_sizes.split(","))
    # Co-located only (the layouts' exactness is checked above): the whole check must fit
    # in a few minutes of a lent GPU.
    for layout in ({"colocate": True},):
        s = BenchSettings(target=target, draft=draft, batch_sizes=sizes, max_tokens=args.bench_tokens,
                          repeats=args.bench_repeats, device=args.device, policies=("static", "adaptive"),
                          progress=False, **layout)
        result = run_bench(s, "built-in")
        print(f"\nspecray bench {layout}:\n{format_table(result)}", flush=True)
        if not result["greedy_outputs_equal"]:
            failures.append(f"bench {layout}")
    if failures:
        print("MISMATCH: " + ", ".join(failures), file=sys.stderr)
        return 1
    print("every greedy output equals transformers' generate")
    return 0


if __name__ == "__main__":
    sys.exit(main())
