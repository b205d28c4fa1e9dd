"""The device check to run when a GPU machine is at hand: one prepared run of about five
minutes that prints a JSON summary and exits 1 only on a real failure.

    python benchmarks/gpu_check.py [--device auto|cpu|cuda] [--tokens 64] [--json summary.json]

Each part runs in a child process of its own with a hard time budget (``BUDGET_S``): a
start that hangs cannot stall the rest, and what a part finished before its budget ran
out is kept (it writes its results as it goes).

1. exactness: in float32, the built-in pair's greedy output through every runtime layout
   (co-located with and without CUDA graphs, worker actors;
   draft, n-gram and no proposer) must equal transformers' greedy ``generate`` on the same
   device, token for token. A layout that fails to start is recorded, the others run.
   Each reports its CUDA graph counters (replays, eager forwards, capture failures).
2. precision: in bf16, specray's agreement with transformers beside transformers'
   agreement with itself at batch 8 (``runtime/bench/gpu_report.py``: reported, not gated).
3. forward: ``benchmarks/executor_forward.py --graphs``: eager, CUDA graphs and the
   transformers path per forward, graphs checked against eager.
4. bench: ``specray bench`` co-located and with worker actors (on CPU co-located only).
5. tensor_parallel (two GPUs or more; skipped, not failed, with one): the built-in pair
   with ``tensor_parallel_size=2`` (rank 0 beside the draft in the driver's process, rank
   1 an actor on the second GPU, NCCL) must give transformers' float32 greedy output, with
   the draft model and with n-gram proposals.

Failures are ``gpu_report.failures``; exit 2 when specray cannot be imported here.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BUDGET_S = {"exactness": 150, "precision": 90, "forward": 60, "bench": 120, "tensor_parallel": 150}
HERE = Path(__file__).resolve()


class Progress:
    """A part's results, rewritten whole after every item (the parent reads what is there)."""

    def __init__(self, path: str) -> None:
        self.path, self.data = Path(path), {"status": "running", "items": []}
        self.save()

    def save(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data))
        tmp.replace(self.path)


def prompts_and_window(n: int, tokens: int) -> tuple[list[list[int]], int]:
    from specray.runtime.bench.stdlib_corpus import held_out_prompts
    from specray.runtime.model_store import builtin_model
    from specray.workers.model_loader import load_tokenizer

    tok = load_tokenizer(builtin_model("tiny-target"))
    prompts = [tok(t, add_special_tokens=False)["input_ids"] for t in held_out_prompts(n)]
    return prompts, 64 * -(-(max(map(len, prompts)) + tokens + 8) // 64)


def reference(device: str, dtype: str, prompts: list[list[int]], tokens: int, batch: int = 1) -> list[list[int]]:
    """transformers' greedy generate, ``batch`` prompts at a time (left padded past 1)."""
    from specray.runtime.bench.hf_runner import HFRunner
    from specray.runtime.bench.settings import BenchSettings
    from specray.runtime.model_store import builtin_model

    hf = HFRunner(BenchSettings(target=builtin_model("tiny-target"), draft=None, device=device, dtype=dtype))
    out = []
    for i in range(0, len(prompts), batch):
        out += hf.generate(prompts[i:i + batch], tokens, False, 0.0, 0)[0]
    return out


def layouts(device: str) -> list[tuple[str, dict, str]]:
    half = {"target_resources": {"GPU": 0.5}, "draft_resources": {"GPU": 0.5}} if device == "cuda" else {}
    kinds = {"co-located": {"layout": "colocated"}, "co-located eager": {"layout": "colocated", "cuda_graphs": False},
             "actors": {"layout": "actors", **half}}
    # Two CPU cores start an actor runtime in seconds: there, every proposer co-located only.
    every = ("draft", "ngram", "none")
    return [(name, layout, p) for name, layout in kinds.items()
            for p in (every if device == "cuda" or name == "co-located" else ("draft",))]


def timed_greedy(cfg, prompts: list[list[int]], tokens: int, expected: list[list[int]], item: dict) -> dict:
    """Greedy ``prompts`` on a runtime of ``cfg``: fills ``item`` with exactness against
    ``expected``, tokens/s and acceptance; returns the runtime's metrics."""
    from specray import SamplingParams, SpecRuntime

    rt = SpecRuntime(cfg)
    try:
        t1 = time.perf_counter()
        outs = rt.generate(prompts, SamplingParams(max_tokens=tokens, temperature=0.0))
        dt = time.perf_counter() - t1
        m = rt.metrics()
    finally:
        rt.shutdown()
    got = [o.token_ids for o in outs]
    item.update(exact=got == expected, tokens_per_s=round(sum(map(len, got)) / dt, 1),
                acceptance_rate=m["acceptance_rate"])
    return m


def graph_counters(m: dict) -> dict:
    from specray.runtime.bench.run import graph_figures

    return graph_figures(m)


def part_exactness(args, prog: Progress) -> None:
    import ray

    from specray import RuntimeConfig
    from specray.runtime.model_store import builtin_model

    prompts, window = prompts_and_window(8, args.tokens)
    expected = reference(args.device, "float32", prompts, args.tokens)
    target, draft = builtin_model("tiny-target"), builtin_model("tiny-draft")
    ray.init(address="local", include_dashboard=False, log_to_driver=False)
    for name, layout, proposer in layouts(args.device):
        item = {"layout": name, "proposer": proposer, "cuda_graphs": layout.get("cuda_graphs", True)}
        t0 = time.perf_counter()
        try:
            cfg = RuntimeConfig(target=target, draft=draft if proposer == "draft" else None, proposer=proposer,
                                device=args.device, dtype="float32", max_model_len=window, max_num_seqs=16,
                                placement_timeout_s=60, **layout)
            m = timed_greedy(cfg, prompts, args.tokens, expected, item)
            item.update(graphs=graph_counters(m))
        except Exception as e:  # noqa: BLE001 - one layout failing must not stop the others
            item["error"] = f"{type(e).__name__}: {e}"[:500]
        item["wall_s"] = round(time.perf_counter() - t0, 1)
        print(f"exactness {name:16} {proposer:6} " + json.dumps({k: v for k, v in item.items()
                                                                 if k not in ("layout", "proposer")}), flush=True)
        prog.data["items"].append(item)
        prog.save()
    ray.shutdown()


def part_precision(args, prog: Progress) -> None:
    import ray

    from specray import RuntimeConfig, SamplingParams, SpecRuntime
    from specray.runtime.bench.gpu_report import precision_report
    from specray.runtime.model_store import builtin_model

    dtype = "bfloat16"
    prompts, window = prompts_and_window(8, args.tokens)
    ref1 = reference(args.device, dtype, prompts, args.tokens)
    ref8 = reference(args.device, dtype, prompts, args.tokens, batch=8)
    ray.init(address="local", include_dashboard=False, log_to_driver=False)
    rt = SpecRuntime(RuntimeConfig(target=builtin_model("tiny-target"), draft=builtin_model("tiny-draft"),
                                   device=args.device, dtype=dtype, layout="colocated", max_model_len=window,
                                   max_num_seqs=16))
    try:
        got = [o.token_ids for o in rt.generate(prompts, SamplingParams(max_tokens=args.tokens, temperature=0.0))]
        prog.data.update(dtype=dtype, graphs=graph_counters(rt.metrics()), **precision_report(got, ref1, ref8, 8))
    finally:
        rt.shutdown()
        ray.shutdown()
    print("precision " + json.dumps({k: v for k, v in prog.data.items() if k not in ("items", "status")}), flush=True)
    prog.save()


def part_bench(args, prog: Progress) -> None:
    import ray

    from specray.runtime.bench.report import format_table
    from specray.runtime.bench.run import run_bench
    from specray.runtime.bench.settings import BenchSettings
    from specray.runtime.model_store import builtin_model

    cuda = args.device == "cuda"
    ray.init(address="local", include_dashboard=False, log_to_driver=False)
    prog.data["layouts"] = {}
    # Two CPU cores start the actors layout's dozen actors in about a minute: there the bench
    # runs co-located only (exactness has already run every layout).
    for name, colocate in (("co-located", True), ("actors", False))[:2 if cuda else 1]:
        s = BenchSettings(target=builtin_model("tiny-target"), draft=builtin_model("tiny-draft"),
                          batch_sizes=(1, 8, 32) if cuda else (1,), max_tokens=args.tokens if cuda else 16,
                          repeats=2 if cuda else 1, device=args.device, policies=("static",), progress=False,
                          colocate=colocate, overlap=False)
        try:
            result = run_bench(s, "built-in")
            print(f"\nspecray bench {name}:\n{format_table(result)}", flush=True)
            keep = ("greedy_outputs_equal", "mismatches", "measured_speedup", "analytic_bound", "alpha", "graphs")
            entry = {k: result[k] for k in keep}
            entry["tokens_per_s"] = {f"{r['system']}/{r['proposer']}/b{r['batch_size']}/{r['mode']}": r["tokens_per_s"]
                                     for r in result["runs"]}
        except Exception as e:  # noqa: BLE001 - the other layout still runs
            entry = {"error": f"{type(e).__name__}: {e}"[:500]}
        prog.data["layouts"][name] = entry
        prog.save()
    ray.shutdown()


def part_tensor_parallel(args, prog: Progress) -> None:
    import ray
    import torch

    from specray import RuntimeConfig
    from specray.runtime.model_store import builtin_model

    gpus = torch.cuda.device_count() if args.device == "cuda" else 0
    if gpus < 2:
        prog.data["skipped"] = f"tensor parallel needs two GPUs, this machine has {gpus}"
        print(f"tensor_parallel skipped: {prog.data['skipped']}", flush=True)
        return
    prompts, window = prompts_and_window(8, args.tokens)
    expected = reference(args.device, "float32", prompts, args.tokens)
    target, draft = builtin_model("tiny-target"), builtin_model("tiny-draft")
    ray.init(address="local", include_dashboard=False, log_to_driver=False)
    for proposer in ("draft", "ngram"):
        item = {"proposer": proposer, "tensor_parallel_size": 2}
        t0 = time.perf_counter()
        try:
            cfg = RuntimeConfig(target=target, draft=draft if proposer == "draft" else None, proposer=proposer,
                                device="cuda", dtype="float32", layout="colocated", tensor_parallel_size=2,
                                max_model_len=window, max_num_seqs=16, placement_timeout_s=60)
            m = timed_greedy(cfg, prompts, args.tokens, expected, item)
            item.update(reported_tp=m["tensor_parallel_size"])
        except Exception as e:  # noqa: BLE001 - recorded; the other proposer still runs
            item["error"] = f"{type(e).__name__}: {e}"[:500]
        item["wall_s"] = round(time.perf_counter() - t0, 1)
        print("tensor_parallel " + json.dumps(item), flush=True)
        prog.data["items"].append(item)
        prog.save()
    ray.shutdown()


def run_forward(args, budget: float) -> dict:
    sizes = "1,3,8,13,32" if args.device == "cuda" else "1,3"
    cmd = [sys.executable, str(HERE.with_name("executor_forward.py")), "--device", args.device, "--batch-sizes",
           sizes, "--repeats", "50" if args.device == "cuda" else "5", "--graphs"]
    rc, out = run_child(cmd, budget, capture=True)
    print(out, end="", flush=True)
    lines = out.splitlines()
    table = [ln for ln in lines if ln[:5].strip().isdigit()]
    found = [ln[5:] for ln in lines if ln.startswith("FAIL ")]
    part = {"status": "ok", "rc": rc, "table": table, "failures": found}
    if rc is None:
        part.update(status="timeout", error=f"past its {budget:.0f} s budget")
    elif rc != 0 and not (rc == 1 and found):      # exit 1 with FAIL lines: the check's own verdict
        part.update(status="error", error=(lines or ["no output"])[-1])
    return part


def run_child(cmd: list[str], budget: float, capture: bool = False) -> tuple[int | None, str]:
    """Run ``cmd`` in its own process group; past ``budget`` seconds the group is killed
    (Ray's processes with it) and the return code is None."""
    proc = subprocess.Popen(cmd, start_new_session=True, stdout=subprocess.PIPE if capture else None,
                            stderr=subprocess.STDOUT if capture else None, text=True)
    try:
        out, _ = proc.communicate(timeout=budget)
        return proc.returncode, out or ""
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return None, out or ""


def run_part(name: str, args, budget: float) -> dict:
    with tempfile.TemporaryDirectory(prefix="gck") as tmp:
        path = os.path.join(tmp, "part.json")
        cmd = [sys.executable, str(HERE), "--device", args.device, "--tokens", str(args.tokens), "--part", name,
               "--part-out", path]
        rc, _ = run_child(cmd, budget)
        try:
            part = json.loads(Path(path).read_text())
        except (OSError, ValueError):
            part = {}
    if rc is None:
        part.update(status="timeout", error=f"past its {budget:.0f} s budget")
    elif rc != 0 or part.get("status") != "ok":
        part.update(status="error", error=part.get("error") or f"exit status {rc}")
    return part


PARTS = {"exactness": part_exactness, "precision": part_precision, "bench": part_bench,
         "tensor_parallel": part_tensor_parallel}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--json", help="also write the summary here")
    ap.add_argument("--part", choices=list(PARTS), help=argparse.SUPPRESS)
    ap.add_argument("--part-out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    try:
        import specray  # noqa: F401
    except ImportError:
        print("specray is not importable by this Python: run `pip install -e .` in the repository first",
              file=sys.stderr)
        return 2
    if args.part:
        prog = Progress(args.part_out)
        try:
            PARTS[args.part](args, prog)
            prog.data["status"] = "ok"
        except Exception as e:  # noqa: BLE001 - reported by the parent
            prog.data.update(status="error", error=f"{type(e).__name__}: {e}"[:500])
        prog.save()
        return 0
    import torch

    # Resolved once, here: a child on a machine without CUDA must not ask Ray for GPUs.
    args.device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    env_tmp = tempfile.mkdtemp(prefix="gck", dir="/tmp")
    os.environ.setdefault("RAY_TMPDIR", env_tmp)      # a private Ray per part, away from any other
    summary = {"device": args.device, "dtype_exact": "float32", "parts": {}}
    t_all = time.perf_counter()
    for name in ("exactness", "precision", "forward", "bench", "tensor_parallel"):
        t0 = time.perf_counter()
        print(f"== {name} (budget {BUDGET_S[name]} s)", flush=True)
        part = run_forward(args, BUDGET_S[name]) if name == "forward" else run_part(name, args, BUDGET_S[name])
        part["wall_s"] = round(time.perf_counter() - t0, 1)
        summary["parts"][name] = part
    from specray.runtime.bench.gpu_report import failures

    summary["wall_s"] = round(time.perf_counter() - t_all, 1)
    summary["failures"] = failures(summary)
    text = json.dumps(summary, indent=1)
    print("JSON summary:\n" + text, flush=True)
    if args.json:
        Path(args.json).write_text(text)
    shutil.rmtree(env_tmp, ignore_errors=True)
    return 1 if summary["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
