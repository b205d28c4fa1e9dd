"""Verify steps of a tensor-parallel target on CPU, beside the same model whole.

    python benchmarks/tp_scaling.py [--model DIR] [--batch-sizes 1,8] [--k 4] [--context 64]
                                    [--repeats 20] [--rounds 5] [--setups a,b,...] [--smoke]
                                    [--json out.json]

Four set-ups (``--setups`` picks some; ``tp1_1t`` always runs), side by side in one run,
each in processes of its own so thread settings do not leak from one to the next:

- ``tp1_1t``: the whole model in one process with one torch thread;
- ``tp2``: two ranks (float32), one process and one thread each, meeting in shared memory;
- ``tp2_gloo``: the same two ranks meeting over gloo (loopback TCP);
- ``tp1_2t``: the whole model in one process with two threads.

The set-ups take turns, ``--rounds`` times, so a change in the machine's load reaches each
of them alike; a ratio is taken within each round, and reported as its geometric mean with
a 95 % interval over the rounds.

Each prefills ``batch`` sequences of ``--context`` tokens, then times verify-shaped steps
(k + 1 tokens a sequence, every row's logits, as ``TargetWorker.verify`` asks) over the
same positions, and reports the median milliseconds per step, the speedups over
``tp1_1t``, and for two ranks the time rank 0 spent in collectives (the all-reduces and the
logits' gather) per step, both medians, and the largest logit difference from
``tp1_1t`` (exit 1 past float32 noise). The default model is SmolLM2-135M (``specray models fetch
smollm2``; its 9 query and 3 KV heads split 6 + 3 and 2 + 1); ``--smoke`` runs a tiny
random model for a few steps, to check the script works. The figures mean something only
on an otherwise idle machine with two free cores.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import socket
import statistics
import tempfile
import time
from dataclasses import replace

# name -> (ranks, threads a rank, shared memory between ranks)
SETUPS = {"tp1_1t": (1, 1, True), "tp2": (2, 1, True), "tp2_gloo": (2, 1, False), "tp1_2t": (1, 2, True)}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _plan(sids, computed, new, tokens):
    from specray.scheduler.messages import StepPlan

    n = len(sids)
    return StepPlan(step_id=0, width=0, seq_ids=sids, num_computed=computed, num_new=new, token_ids=tokens,
                    num_slots=[c + q for c, q in zip(computed, new)], proposal_lens=[0] * n, proposal_token_ids=[],
                    draft_rows=[], temperature=[0.0] * n, top_k=[0] * n, top_p=[1.0] * n, seeds=[0] * n,
                    free_seq_ids=[])


def _rank(args: dict, rank: int, size: int, threads: int, shm: bool, port: int, out) -> None:
    """One process: its rank of the model, then per batch size a prefill and timed verify
    steps; rank 0 puts {batch: (median ms, collective ms a step)} on ``out``."""
    import torch

    torch.set_num_threads(threads)
    if args["pin"] and threads == 1 and hasattr(os, "sched_setaffinity"):
        # Each one-thread rank on a core of its own, as a deployment binds its ranks: else
        # the scheduler may put both ranks on one core now and then, and the one that
        # waits spins beside the one that computes.
        os.sched_setaffinity(0, {rank % os.cpu_count()})
    from datetime import timedelta

    import torch.distributed as dist

    from specray.scheduler.block_manager import blocks_needed
    from specray.scheduler.config import CacheConfig
    from specray.workers.config import ModelConfig
    from specray.workers.model_runner import ModelRunner
    from specray.workers.tensor_parallel import RankGroup

    group = None
    if size > 1:
        store = dist.TCPStore("127.0.0.1", port, world_size=size, is_master=rank == 0,
                              timeout=timedelta(seconds=300))
        group = RankGroup(store, rank, size, torch.device("cpu"), 300.0, shared_memory=shm)
        if shm and group.transport != "shm":
            raise SystemExit("the ranks could not share memory here")
    k, ctx, batches = args["k"], args["context"], args["batch_sizes"]
    window = ctx + k + 8
    top = max(batches)
    model = ModelConfig(target=args["model"], dtype="float32", device="cpu", max_model_len=window, cuda_graphs=False)
    cache = CacheConfig(max_num_seqs=top, num_kv_blocks=top * blocks_needed(window + 1, 16) + 8)
    r = ModelRunner(args["model"], model, cache, window, group=group)
    g = torch.Generator().manual_seed(0)
    results = {}
    for b in batches:
        sids = list(range(1000 * b, 1000 * b + b))
        prompt = torch.randint(0, r.vocab_size, (b * ctx,), generator=g).tolist()
        plan = _plan(sids, [0] * b, [ctx] * b, prompt)
        r.kv.apply(plan)
        r.forward(sids, [0] * b, [ctx] * b, r.to_device(prompt), r.to_device([ctx * (i + 1) - 1 for i in range(b)]))
        fed = torch.randint(0, r.vocab_size, (b * (k + 1),), generator=g).tolist()
        step = _plan(sids, [ctx] * b, [k + 1] * b, fed)
        ids, rows = r.to_device(fed), r.to_device(list(range(b * (k + 1))))
        times, comms = [], []
        for _ in range(args["warmup"] + args["repeats"]):
            comm0 = group.comm_s if group else 0.0
            t0 = time.perf_counter()
            r.kv.apply(step)
            logits = r.forward(sids, [ctx] * b, [k + 1] * b, ids, rows)
            times.append(time.perf_counter() - t0)
            comms.append(group.comm_s - comm0 if group else 0.0)
        w = args["warmup"]
        results[b] = (statistics.median(times[w:]) * 1e3, statistics.median(comms[w:]) * 1e3,
                      logits.numpy().copy())     # numpy: a tensor would cross as shared memory of an ended process
        r.kv.apply(replace(_plan([], [], [], []), free_seq_ids=sids))      # the next batch size starts empty
    if rank == 0:
        out.put(results)
    if group is not None:
        group.close()


def _tiny_model() -> str:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    path = tempfile.mkdtemp(prefix="specray-tp-smoke-")
    cfg = LlamaConfig(vocab_size=101, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=6, num_key_value_heads=3, max_position_embeddings=256)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).float().save_pretrained(path)
    return path


def _run_setup(ctx, args: dict, name: str) -> dict:
    size, threads, shm = SETUPS[name]
    out, port = ctx.Queue(), _free_port()
    procs = [ctx.Process(target=_rank, args=(args, r, size, threads, shm, port, out)) for r in range(size)]
    for p in procs:
        p.start()
    result = out.get(timeout=1800)
    for p in procs:
        p.join(timeout=60)
        if p.exitcode:
            raise SystemExit(f"{name}: rank process exited with {p.exitcode}")
    return result


def _ratio(base: list[float], other: list[float]) -> str:
    """base / other per round (a speedup of ``other``): geometric mean [95 % interval]."""
    from specray.runtime.bench.stats import within_repeats

    r = within_repeats(base, other)
    ci = f" [{r['ci95'][0]:.2f}, {r['ci95'][1]:.2f}]" if r["ci95"] else ""
    return f"{r['geomean']:.2f}x{ci}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="a checkpoint directory (default: SmolLM2-135M)")
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--k", type=int, default=4, help="proposals a verify step scores (k + 1 rows a sequence)")
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=20, help="timed steps a round")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=5, help="turns of every set-up")
    ap.add_argument("--no-pin", dest="pin", action="store_false",
                    help="leave one-thread ranks unbound (by default rank r runs on core r)")
    ap.add_argument("--setups", default=",".join(SETUPS), help="which set-ups run (tp1_1t always does)")
    ap.add_argument("--smoke", action="store_true", help="a tiny random model, a few steps: the script works")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    if a.smoke:
        model, a.repeats, a.warmup, a.context, a.rounds = _tiny_model(), 3, 1, 16, 2
    elif a.model:
        model = a.model
    else:
        from specray.runtime.model_store import fetch

        model = fetch("smollm2")
    args = {"model": model, "k": a.k, "context": a.context, "repeats": a.repeats, "warmup": a.warmup, "pin": a.pin,
            "batch_sizes": [int(x) for x in a.batch_sizes.split(",")]}
    setups = ["tp1_1t"] + [n for n in a.setups.split(",") if n != "tp1_1t"]
    unknown = [n for n in setups if n not in SETUPS]
    if unknown:
        ap.error(f"--setups: no set-up {', '.join(unknown)}; there are {', '.join(SETUPS)}")
    ctx = mp.get_context("spawn")
    rounds = [{name: _run_setup(ctx, args, name) for name in setups} for _ in range(a.rounds)]
    summary: dict = {"model": model, "k": a.k, "context": a.context, "rounds": a.rounds, "batches": {}}
    print(f"{'batch':>5} {'setup':>8} {'ms/step':>9} {'collective ms':>14} {'max|dlogit|':>12}   speedup over tp1_1t")
    failed = []
    for b in args["batch_sizes"]:
        ms = {n: [r[n][b][0] for r in rounds] for n in setups}
        comm = {n: [r[n][b][1] for r in rounds] for n in setups}
        row = summary["batches"][b] = {}
        for name in setups:
            ref = rounds[0]["tp1_1t"][b][2]
            diff = max(float(abs(r[name][b][2] - ref).max()) for r in rounds)
            row[name] = {"ms_per_step": ms[name], "collective_ms": comm[name], "max_abs_dlogit": diff}
            speed = "" if name == "tp1_1t" else _ratio(ms["tp1_1t"], ms[name])
            print(f"{b:>5} {name:>8} {statistics.median(ms[name]):>9.2f} {statistics.median(comm[name]):>14.2f} "
                  f"{diff:>12.2e}   {speed}")
            # The same math summed in another order: float32 noise, relative to the logits' scale.
            if diff > 1e-4 * max(1.0, float(abs(ref).max())):
                failed.append(f"batch {b} {name}: logits differ from tp1_1t by {diff:.3g}")
        if "tp2" in ms:
            others = [f"over {n} {_ratio(ms[n], ms['tp2'])}" + (" (goal >= 0.9)" if n == "tp1_2t" else "")
                      for n in ("tp1_2t", "tp2_gloo") if n in ms]
            print(f"{b:>5}   tp2 over tp1_1t {_ratio(ms['tp1_1t'], ms['tp2'])} (goal >= 1.5); " + "; ".join(others))
    for f in failed:
        print("FAIL " + f)
    if a.smoke:
        shutil.rmtree(model, ignore_errors=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(summary, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
