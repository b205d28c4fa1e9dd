"""Speculation policies side by side on one runtime: the least noisy comparison this
project has on a shared machine.

    python benchmarks/policy_side_by_side.py [--target DIR --draft DIR | --random-draft]
                                             [--batch-sizes 1,8,32] [--tokens 64] [--repeats 5]
                                             [--rotate-prompts] [--static-k 6,8]

One in-process driver (workers co-located, no Ray) serves every run; before each run its
scheduler gets one of several policy objects, each keeping what it has learned across
its own runs: static k, adaptive, and plain decoding (static with speculation disabled
at batch 1, so the draft is never called). ``--static-k`` adds fixed k's, so adaptive can
be held to the best fixed k rather than to one. Runs go policy by policy within each
repeat and batch size, in an order rotated per repeat, so machine noise hits them alike.
Reports median tokens/s and the min-max spread per (batch, policy), and each one's
ratio to the best other: of medians, and within each repeat (median, min-max). Then, per
(batch, policy), where a step's time went (ms per step over all its runs): scheduling
(the policy's choice included), the draft's and the target's calls, and the rest of the
step (merge and update, the policy's bookkeeping included). Those figures come from
the same steps the ratios do and move far less with the machine's noise: what a policy's
own Python costs a step shows there even when the ratios scatter by 10 %.

Like ``specray bench``, every repeat serves the same prompts: batch 1 is one text, and a
policy that suits that text (or learns it over the repeats) looks better than it is.
``--rotate-prompts`` gives each repeat the next prompts of the held-out set instead
(batch 1: another text every repeat; all three policies get the same ones).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections import Counter
from pathlib import Path

MODELS = Path(__file__).resolve().parent.parent / "models"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=str(MODELS / "tiny-target"))
    ap.add_argument("--draft", default=str(MODELS / "tiny-draft"))
    ap.add_argument("--random-draft", action="store_true", help="the draft's architecture with random weights")
    ap.add_argument("-k", type=int, default=4)
    ap.add_argument("--batch-sizes", default="1,8,32")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--rotate-prompts", action="store_true",
                    help="each repeat serves the next held-out prompts (batch 1: another text every repeat)")
    ap.add_argument("--static-k", default="", help="more fixed k's to run, e.g. 6,8")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()

    import torch

    from specray.runtime.bench.hf_runner import random_copy
    from specray.runtime.bench.run import batch_prompts, rotated
    from specray.runtime.bench.stats import within_repeats
    from specray.runtime.bench.stdlib_corpus import held_out_prompts
    from specray.runtime.config import RuntimeConfig
    from specray.runtime.driver.core import DriverCore
    from specray.scheduler.adaptive import AdaptivePolicy
    from specray.scheduler.config import SpeculationConfig
    from specray.scheduler.sampling_params import SamplingParams
    from specray.scheduler.speculation_policy import StaticPolicy

    torch.set_num_threads(1)      # as in Ray actors and specray bench
    draft = random_copy(args.draft, tempfile.mkdtemp(prefix="random-draft-")) if args.random_draft else args.draft
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    static_ks = sorted({int(x) for x in args.static_k.split(",") if x.strip()} - {args.k})
    if static_ks and min(static_ks) < 1:
        ap.error("--static-k: every k must be >= 1")
    # The runtime reserves for the widest policy; each policy keeps to its own k.
    config = RuntimeConfig(target=args.target, draft=draft, num_speculative_tokens=max([args.k, *static_ks]),
                           device="cpu", dtype="float32", max_num_seqs=max(batch_sizes))
    drv = DriverCore(config.replace(layout="colocated"))

    def spec(k: int, **kw) -> SpeculationConfig:
        return SpeculationConfig(num_speculative_tokens=k, **kw)

    policies = {"static": StaticPolicy(spec(args.k)),
                "adaptive": AdaptivePolicy.of(spec(args.k, speculation_policy="adaptive")),
                "none": StaticPolicy(spec(args.k, disable_by_batch_size=1)),
                **{f"static{k}": StaticPolicy(spec(k)) for k in static_ks}}
    params = SamplingParams(max_tokens=args.tokens, temperature=0.0)
    tokens_per_s: dict[tuple[int, str], list[float]] = {}
    phase_s: dict[tuple[int, str], Counter] = {}
    try:
        warm = held_out_prompts(2)
        drv.wait(drv.submit(warm, [SamplingParams(max_tokens=4, temperature=0.0)] * 2).request_ids, timeout=600)
        names = list(policies)
        pool = held_out_prompts(max(32, *batch_sizes))
        for rep in range(args.repeats):
            for b in batch_sizes:
                prompts = [pool[i] for i in batch_prompts(len(pool), b, rep, args.rotate_prompts)]
                # Rotated per repeat: a fixed order gives each policy the same neighbour
                # every time, and that alone moves a comparison by several percent.
                for name in rotated(names, rep):
                    drv.scheduler.policy = policies[name]
                    before = drv.metrics()
                    t0 = time.perf_counter()
                    outs = drv.wait(drv.submit(prompts, [params] * b).request_ids, timeout=600)
                    dt = time.perf_counter() - t0
                    tokens_per_s.setdefault((b, name), []).append(sum(len(o.token_ids) for o in outs) / dt)
                    after = drv.metrics()
                    phase_s.setdefault((b, name), Counter()).update(
                        {key: after[key] - before[key] for key in PHASE_KEYS})
    finally:
        drv.shutdown()

    rows = []
    print(f"{'batch':>5}  {'policy':9} {'tokens/s':>9}  {'spread':>11}  vs best other: medians, within repeats "
          f"(min-max), geometric mean [95 %]")
    for b in batch_sizes:
        medians = {name: statistics.median(tokens_per_s[(b, name)]) for name in policies}
        for name in policies:
            v = tokens_per_s[(b, name)]
            best = max((o for o in policies if o != name), key=medians.__getitem__)
            ratio = medians[name] / medians[best]
            # The same comparison repeat by repeat (each ratio's runs ran seconds apart),
            # against that one policy: each repeat's faster one would be biased upwards.
            paired = within_repeats(v, tokens_per_s[(b, best)])
            rows.append({"batch_size": b, "policy": name, "tokens_per_s": medians[name], "samples": v, "min": min(v),
                         "max": max(v), "vs_best_other": ratio, "within_repeats_vs_best_other": paired})
            ci = "[{:.2f}-{:.2f}]".format(*paired["ci95"]) if paired["ci95"] else ""
            print(f"{b:5d}  {name:9} {medians[name]:9.1f}  {min(v):5.0f}-{max(v):<5.0f}  {ratio:.3f}   "
                  f"{paired['median']:.3f} ({paired['min']:.2f}-{paired['max']:.2f})  {paired['geomean']:.3f} {ci}")
    if "adaptive" in policies:
        print(f"\n{'batch':>5}  adaptive over each, within repeats: geometric mean [95 %]")
        for b in batch_sizes:
            pairs = {name: within_repeats(tokens_per_s[(b, "adaptive")], tokens_per_s[(b, name)])
                     for name in policies if name != "adaptive"}
            print(f"{b:5d}  " + "  ".join(f"{name} {r['geomean']:.3f}" + (" [{:.2f}-{:.2f}]".format(*r["ci95"])
                                                                          if r["ci95"] else "")
                                          for name, r in pairs.items()))
    print(f"\n{'batch':>5}  {'policy':9} ms per step: "
          f"{'step':>7} {'schedule':>9} {'draft':>7} {'verify':>7} {'rest':>7}")
    for row in rows:
        ms = step_ms(phase_s[(row["batch_size"], row["policy"])])
        row["step_ms"] = ms
        print(f"{row['batch_size']:5d}  {row['policy']:9}              {ms['step']:7.3f} {ms['schedule']:9.3f} "
              f"{ms['draft']:7.3f} {ms['verify']:7.3f} {ms['rest']:7.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"random_draft": args.random_draft, "tokens": args.tokens,
                                               "repeats": args.repeats, "rotate_prompts": args.rotate_prompts,
                                               "runs": rows}, indent=2))


PHASE_KEYS = ("num_steps", "busy_s", "schedule_s", "draft_compute_s", "verify_compute_s")


def step_ms(total: Counter) -> dict[str, float]:
    """Milliseconds per step from summed metrics deltas. In process the worker calls are
    their compute: the rest of a step is the driver's own work after scheduling."""
    steps = max(total["num_steps"], 1)
    ms = {"step": total["busy_s"], "schedule": total["schedule_s"], "draft": total["draft_compute_s"],
          "verify": total["verify_compute_s"]}
    ms["rest"] = ms["step"] - ms["schedule"] - ms["draft"] - ms["verify"]
    return {key: value / steps * 1e3 for key, value in ms.items()}


if __name__ == "__main__":
    main()
