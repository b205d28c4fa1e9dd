"""Paired A/B of two source trees of specray: is a change's gain beyond the noise?

    python benchmarks/ab_revisions.py --base HEAD~1 [--other WORKTREE_OR_REV]
                                      [--proposer none] [--batch 1] [--tokens 64] [--rounds 16]

One worker process per tree (``--base``: a git revision, checked out into a temporary
worktree; ``--other``: this working tree by default, or another revision), each serving
an in-process runtime (``DriverCore``, workers co-located, no Ray) of the built-in pair.
The parent sends the same request to both, alternating which goes first, ``--rounds``
times, and checks their greedy outputs agree. Prints each tree's median tokens/s and the
geometric mean of the per-round ratio (other over base) with its 95 % interval
(Student's t on the log ratios): machine noise hits both trees alike within a round, so
the interval says whether the change moved anything.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

WORKER = r"""
import json, sys, time
import torch
torch.set_num_threads(1)
from specray import RuntimeConfig, SamplingParams
from specray.runtime.model_store import builtin_model
from specray.runtime.driver.core import DriverCore
from specray.runtime.bench.stdlib_corpus import held_out_prompts

proposer, batch, tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
kw = dict(target=builtin_model("tiny-target"), proposer=proposer)
if proposer == "draft":
    kw["draft"] = builtin_model("tiny-draft")
d = DriverCore(RuntimeConfig(layout="colocated", **kw), export_metrics=False)
prompts = held_out_prompts(batch * 40)
params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)

def run(ps):
    ids = d.submit(ps, [params] * len(ps)).request_ids
    while (out := d.wait(ids, 1.0)) is None:
        pass
    return out

run(prompts[:batch])
print("ready", flush=True)
for line in sys.stdin:
    i = int(line)
    ps = prompts[(i * batch) % len(prompts):][:batch]
    t = time.perf_counter()
    out = run(ps)
    print(json.dumps({"s": time.perf_counter() - t, "tokens": [o.token_ids for o in out]}), flush=True)
d.shutdown()
"""


def package_dir(tree: Path, into: Path) -> Path:
    """A directory that imports as ``specray`` from ``tree`` (the package is spread over
    runtime/, scheduler/, workers/ and models/, as pyproject's package-dir maps it)."""
    pkg = into / "specray"
    pkg.mkdir(parents=True)
    for f in (tree / "runtime").iterdir():
        (pkg / f.name).symlink_to(f)
    for name in ("scheduler", "workers", "models"):
        (pkg / name).symlink_to(tree / name)
    return into


def checkout(rev: str, into: Path) -> Path:
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(into), rev], check=True,
                   capture_output=True)
    return into


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", required=True, help="git revision measured as the baseline")
    ap.add_argument("--other", default=None, help="git revision to compare (default: this working tree)")
    ap.add_argument("--proposer", default="none", choices=["none", "ngram", "suffix", "draft"])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=16)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="specray-ab-") as tmp:
        tmp = Path(tmp)
        trees, worktrees = [], []
        for name, rev in (("base", args.base), ("other", args.other)):
            if rev is None:
                trees.append(ROOT)
            else:
                worktrees.append(checkout(rev, tmp / f"{name}-tree"))
                trees.append(worktrees[-1])
        try:
            procs = []
            for i, tree in enumerate(trees):
                env = dict(os.environ, PYTHONPATH=str(package_dir(tree, tmp / f"pkg{i}")))
                procs.append(subprocess.Popen(
                    [sys.executable, "-c", WORKER, args.proposer, str(args.batch), str(args.tokens)], env=env,
                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True))
            for p in procs:
                if p.stdout.readline().strip() != "ready":
                    raise RuntimeError("a worker process did not start")
            seconds: list[list[float]] = [[], []]
            for r in range(args.rounds):
                got = {}
                for j in (0, 1) if r % 2 == 0 else (1, 0):
                    procs[j].stdin.write(f"{r}\n")
                    procs[j].stdin.flush()
                    got[j] = json.loads(procs[j].stdout.readline())
                if got[0]["tokens"] != got[1]["tokens"]:
                    print(f"round {r}: the two trees' greedy outputs differ", file=sys.stderr)
                    return 1
                for j in (0, 1):
                    seconds[j].append(got[j]["s"])
            for p in procs:
                p.stdin.close()
                p.wait()
        finally:
            for w in worktrees:
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(w)], check=False,
                               capture_output=True)
    from specray.runtime.bench.stats import within_repeats

    tps = [[args.batch * args.tokens / x for x in s] for s in seconds]
    ratio = within_repeats(tps[1], tps[0])
    low, high = ratio["ci95"] or (float("nan"), float("nan"))
    print(f"{args.proposer} batch {args.batch}: base {statistics.median(tps[0]):.0f} tokens/s, other "
          f"{statistics.median(tps[1]):.0f} tokens/s; other over base {ratio['geomean']:.3f} "
          f"(95 %: {low:.3f}-{high:.3f}), {len(seconds[0])} rounds")
    return 0


if __name__ == "__main__":
    sys.exit(main())
