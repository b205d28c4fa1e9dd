"""Time to recover from a driver kill: SIGKILL the driver actor's process in the middle of
a stream and time until that stream's next token arrives (the restart, the new workers
loading their models, the resubmission, the KV recompute, the first step).

    python benchmarks/driver_recovery.py [--target DIR --draft DIR | --proposer ngram]
                                         [--layout auto|actors|colocated] [--repeats 5]

Built-in pair by default. Each repeat streams one greedy request (and ``--batch - 1``
others beside it through ``generate``), kills the driver once the stream has 16 tokens,
and checks the resumed outputs equal the run without a kill. Prints, per repeat and as
medians: kill -> first token after (what the client sees), and the driver's own figures
(``metrics()["driver_recovery_s"]``: its process start to serving; ``driver_first_token_s``:
to its first step).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import threading
import time

import ray

from specray import RuntimeConfig, SamplingParams, SpecRuntime, builtin_model


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default=None)
    p.add_argument("--draft", default=None)
    p.add_argument("--proposer", default="draft")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--batch", type=int, default=8, help="requests in flight at the kill (one of them streamed)")
    p.add_argument("--tokens", type=int, default=96)
    p.add_argument("--layout", default="auto", choices=["auto", "actors", "colocated"])
    args = p.parse_args()
    target = args.target or builtin_model("tiny-target")
    draft = args.draft if args.proposer in ("draft", "draft+suffix") else None
    if draft is None and args.proposer in ("draft", "draft+suffix"):
        draft = builtin_model("tiny-draft")
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    rt = SpecRuntime(RuntimeConfig(target=target, draft=draft, proposer=args.proposer, num_speculative_tokens=4,
                                   device="cpu", dtype="float32", max_driver_restarts=-1,
                                   layout=args.layout))
    prompts = ["def fibonacci(n):", "import os\n", "class Stack:\n", "for i in range(10):", "while True:\n",
               "x = [1, 2, 3]\n", "def main():\n", "if __name__ =="]
    others = [prompts[(i + 1) % len(prompts)] for i in range(args.batch - 1)]
    params = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)

    def run(kill: bool):
        batch, out = [], {}
        t = threading.Thread(target=lambda: batch.extend(rt.generate(others, params)) if others else None)
        t.start()
        toks = []
        for d in rt.stream(prompts[0], params):
            if "killed" in out and "first_after" not in out and d.token_ids:
                out["first_after"] = time.perf_counter() - out["killed"]
            toks += d.token_ids
            if kill and "killed" not in out and len(toks) >= 16:
                pid = ray.get(rt._driver.pid.remote())
                out["killed"] = time.perf_counter()
                os.kill(pid, signal.SIGKILL)
        t.join()
        return [toks] + [o.token_ids for o in batch], out

    ref, _ = run(False)
    rows = []
    for r in range(args.repeats):
        got, out = run(True)
        if got != ref:
            print("MISMATCH after the restart", file=sys.stderr)
            return 1
        m = rt.metrics()
        rows.append((out["first_after"], m["driver_recovery_s"][-1], m["driver_first_token_s"][-1]))
        print(f"repeat {r}: kill -> first token after {rows[-1][0]:.2f} s; driver start -> serving "
              f"{rows[-1][1]:.2f} s, -> first step {rows[-1][2]:.2f} s", flush=True)
    med = [statistics.median(c) for c in zip(*rows)]
    print(json.dumps({"target": os.path.basename(target.rstrip("/")), "proposer": args.proposer,
                      "layout": rt.metrics()["layout"],
                      "batch": args.batch, "repeats": args.repeats, "kill_to_first_token_s": round(med[0], 2),
                      "min_max_s": [round(min(r[0] for r in rows), 2), round(max(r[0] for r in rows), 2)],
                      "driver_recovery_s": round(med[1], 2), "driver_first_token_s": round(med[2], 2),
                      "num_driver_restarts": rt.metrics()["num_driver_restarts"]}))
    rt.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
