"""One `specray bench` ratio across several fresh runs, with the interval the runs give.

    python benchmarks/repeat_runs.py --runs 8 --out DIR [-- BENCH ARGS]   # e.g. -- --quick --policy both --colocate
    python benchmarks/repeat_runs.py --from DIR [DIR ...]                  # aggregate earlier outputs

A `--quick` bench times 32 tokens per configuration twice: one run's ratio of two
configurations moves by 10-30 % between runs on a shared CPU, and a draft policy's first
run at a batch size is its learning period. This script runs the bench ``--runs`` times
(each a fresh process, so each run starts cold as a user's would), or reads the
``bench.json`` of runs made earlier, and prints per ratio the geometric mean over runs of
each run's own ratio (as the bench computes it: the geometric mean of its paired
repeats), with its 95 % interval (Student's t over runs) and every run's value.

Ratios: specray with no proposer over Hugging Face `generate` per batch size; the draft
(first policy) over Hugging Face assisted generation at batch 1; and, with both draft
policies, adaptive, static k and plain decoding each over the better *mode* of the run
(static k or plain, chosen as the bench chooses its "best other": ``best_config``), and
adaptive over each mode; with `--layouts`, the first layout's draft over the same in each
other layout. A configuration held to the better mode scores below 1 even
where it *is* one of two even modes (the better of two noisy estimates is biased up):
static's and plain decoding's own figures show by how much. Per proposer, adaptive over
static k and over each adaptive variant (the variant's mechanism's gain); suffix decoding
over plain decoding, n-gram lookup and Hugging Face's prompt lookup, and draft+suffix over
the draft alone.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from specray.runtime.bench.stats import best_config, within_repeats


def run_ratios(result: dict) -> dict[str, float]:
    """One bench run's ratios (each the geometric mean of the run's paired repeats)."""
    runs = {(r["system"], r["proposer"], r["batch_size"], r["mode"], r["policy"]): r["samples"]
            for r in result["runs"] if r["k"] is None}
    out: dict[str, float] = {}

    def put(name: str, a: list[float] | None, b: list[float] | None) -> None:
        if a and b and (ratio := within_repeats(a, b)) is not None:
            out[name] = ratio["geomean"]

    batches = sorted({key[2] for key in runs})
    policies = sorted({key[4] for key in runs if key[1] == "draft" and ":" not in key[4]})
    for b in batches:
        put(f"b{b} specray none / hf generate", runs.get(("specray", "none", b, "greedy", "static")),
            runs.get(("hf", "none", b, "greedy", "static")))
    if policies:
        first = "static" if "static" in policies else policies[0]
        put(f"b1 specray draft ({first}) / hf assisted", runs.get(("specray", "draft", 1, "greedy", first)),
            runs.get(("hf", "assisted", 1, "greedy", "static")))
    if {"static", "adaptive"} <= set(policies):
        for b in batches:
            mode = {p: runs.get(("specray", "draft", b, "greedy", p)) for p in policies}
            mode["none"] = runs.get(("specray", "none", b, "greedy", "static"))
            if not all(mode.values()):
                continue
            better = best_config({p: mode[p] for p in ("static", "none")})
            for p in ("adaptive", "static", "none"):
                put(f"b{b} {p} / better mode", mode[p], mode[better])
            put(f"b{b} adaptive / static", mode["adaptive"], mode["static"])
            put(f"b{b} adaptive / none", mode["adaptive"], mode["none"])
    # The first layout's draft (static k) over the same in each other layout (--layouts).
    for b in batches:
        first = runs.get(("specray", "draft", b, "greedy", "static"))
        for lay in ("actors", "colocated", "colocated-all-cores"):
            put(f"b{b} draft / draft@{lay}", first, runs.get(("specray", "draft", b, "greedy", f"static@{lay}")))
        # Pre-drafting (overlap) over serial, and over each other layout's serial draft.
        overlap = runs.get(("specray", "draft", b, "greedy", "static+overlap"))
        put(f"b{b} draft+overlap / draft", overlap, first)
        for lay in ("colocated", "colocated-all-cores"):
            other = runs.get(("specray", "draft", b, "greedy", f"static@{lay}"))
            put(f"b{b} draft+overlap / draft@{lay}", overlap, other)
    # Suffix decoding against plain decoding, prompt lookup and the draft alone (static k).
    for b in batches:
        static = {p: runs.get(("specray", p, b, "greedy", "static")) for p in ("suffix", "draft+suffix", "ngram",
                                                                             "draft", "none")}
        put(f"b{b} suffix / none", static["suffix"], static["none"])
        put(f"b{b} suffix / ngram", static["suffix"], static["ngram"])
        put(f"b{b} draft+suffix / draft", static["draft+suffix"], static["draft"])
        put(f"b{b} ngram / none", static["ngram"], static["none"])
    put("b1 suffix / hf lookup", runs.get(("specray", "suffix", 1, "greedy", "static")),
        runs.get(("hf", "lookup", 1, "greedy", "static")))
    put("b1 sampled suffix / none", runs.get(("specray", "suffix", 1, "sampled", "static")),
        runs.get(("specray", "none", 1, "sampled", "static")))
    # Per proposer: adaptive over static k, and over each adaptive variant (a variant runs
    # the policy with one mechanism off: the ratio is that mechanism's gain).
    variants = sorted({key[4] for key in runs if key[4].startswith("adaptive:")})
    for proposer in ("ngram", "draft"):
        for b in batches:
            adaptive = runs.get(("specray", proposer, b, "greedy", "adaptive"))
            if not adaptive:
                continue
            if proposer == "ngram":
                put(f"b{b} ngram adaptive / static", adaptive, runs.get(("specray", "ngram", b, "greedy", "static")))
                put(f"b{b} ngram adaptive / none", adaptive, runs.get(("specray", "none", b, "greedy", "static")))
            for v in variants:
                put(f"b{b} {proposer} adaptive / {v}", adaptive, runs.get(("specray", proposer, b, "greedy", v)))
    return out


def aggregate(results: list[dict]) -> list[tuple[str, dict, list[float]]]:
    per: dict[str, list[float]] = {}
    for result in results:
        for name, value in run_ratios(result).items():
            per.setdefault(name, []).append(value)
    return [(name, within_repeats(values, [1.0] * len(values)), values) for name, values in per.items()]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    bench_args: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, bench_args = argv[:i], argv[i + 1:]
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=8)
    ap.add_argument("--out", default="repeat_runs_out", help="one subfolder per run")
    ap.add_argument("--from", dest="sources", nargs="+", default=None,
                    help="aggregate these bench output folders (each with a bench.json) instead of running")
    args = ap.parse_args(argv)
    if args.sources:
        paths = [Path(s) / "bench.json" if Path(s).is_dir() else Path(s) for s in args.sources]
        odd = [str(p) for p in paths if p.suffix != ".json"]
        if odd:
            raise SystemExit(f"--from takes bench output folders or bench.json files, not {', '.join(odd)}")
    else:
        if args.runs < 2:
            raise SystemExit("--runs: at least 2 (an interval needs two runs)")
        if any(a == "--out" or a.startswith("--out=") for a in bench_args):
            raise SystemExit("give --out to this script, not to the bench")
        paths = []
        for i in range(1, args.runs + 1):
            out = Path(args.out) / f"run{i}"
            cmd = [sys.executable, "-m", "specray.runtime.entrypoints.cli", "bench", *bench_args, "--out", str(out)]
            print(f"run {i}/{args.runs}: {' '.join(cmd[1:])}", file=sys.stderr, flush=True)
            done = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            if done.returncode:
                sys.stderr.write(done.stderr[-4000:])
                raise SystemExit(f"run {i}: the bench exited with {done.returncode}")
            paths.append(out / "bench.json")
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise SystemExit(f"no bench.json at {', '.join(missing)}")
    results = [json.loads(p.read_text()) for p in paths]
    print(f"{len(results)} runs; each value is one run's geometric mean over its repeats")
    print(f"{'ratio':40s} {'geomean':>8s} {'95 % over runs':>16s}  runs")
    for name, s, values in aggregate(results):
        ci = f"{s['ci95'][0]:.3f}-{s['ci95'][1]:.3f}" if s["ci95"] else "-"
        print(f"{name:40s} {s['geomean']:8.3f} {ci:>16s}  {' '.join(f'{v:.2f}' for v in values)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
