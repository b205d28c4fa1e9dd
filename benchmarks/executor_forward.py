"""Per-forward time of the native executor and the transformers path, side by side.

    python benchmarks/executor_forward.py [--model DIR] [--device cpu] [--dtype auto]
                                          [--batch-sizes 1,32] [--context 64] [--repeats 200]
                                          [--compiled] [--graphs]

For each batch size: one ModelRunner per executor over the same checkpoint and the same
paged cache layout; every sequence is prefilled with ``--context`` tokens, then the
decode (1 token per sequence) and verify-shaped (k+1 = 5 tokens per sequence) forwards
are timed, interleaving the two executors so shared-CPU noise hits both alike. Prints
median milliseconds per forward and the ratio (transformers / native), plus the largest
logit difference between the two paths on the last step. ``--compiled`` adds a third
runner whose native forward goes through ``torch.compile(dynamic=True)`` (its first call
per shape, the compile, is reported and left out of the median). ``--graphs`` adds a
runner whose decode and verify steps replay CUDA graphs (``workers/step_graphs.py``; on a
device without them the same padded forward runs eagerly), with the native eager forward
as its baseline: fresh token ids every repeat, sequences of different lengths, and batch
sizes that need not be buckets, so stale inputs and padding rows show. The largest
graphs-vs-eager logit difference (relative to the largest logit) is checked, as is that
graphs replayed at all; the script exits 1 on a failure.
"""

from __future__ import annotations

import argparse
import statistics
import time


def main() -> int:
    import torch

    from specray.runtime.model_store import builtin_model
    from specray.scheduler.block_manager import blocks_needed
    from specray.scheduler.config import CacheConfig
    from specray.scheduler.messages import StepPlan
    from specray.workers.config import ModelConfig
    from specray.workers.model_runner import ModelRunner

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=builtin_model("tiny-target"))
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--batch-sizes", default="1,32")
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--compiled", action="store_true", help="also time the native forward under torch.compile")
    ap.add_argument("--graphs", action="store_true", help="also time bucketed steps replayed as CUDA graphs")
    ap.add_argument("--graph-tol", type=float, default=5e-2,
                    help="in half precision, the largest graphs-vs-eager logit difference allowed, as a "
                         "fraction of the largest logit (float32: 1e-4)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    def plan(sids, comp, new, toks):
        n = len(sids)
        return StepPlan(step_id=0, width=0, seq_ids=sids, num_computed=comp, num_new=new, token_ids=toks,
                        num_slots=[c + q for c, q in zip(comp, new)], proposal_lens=[0] * n,
                        proposal_token_ids=[], draft_rows=[], temperature=[0.0] * n, top_k=[0] * n,
                        top_p=[1.0] * n, seeds=[0] * n, free_seq_ids=[])

    extra = f" {'compiled ms':>11} {'eager/compiled':>14}" if args.compiled else ""
    extra += f" {'graphs ms':>9} {'eager/graphs':>12} {'max|dlogit|':>11}" if args.graphs else ""
    print(f"{'batch':>5} {'step':>7} {'native ms':>10} {'hf ms':>8} {'ratio':>6} {'max|dlogit|':>11}{extra}")
    kinds = ("native", "transformers") + (("compiled",) if args.compiled else ()) + (("graphs",) if args.graphs else ())
    failures = []
    for b in (int(x) for x in args.batch_sizes.split(",")):
        # Sequence i holds context + (5 i mod 11) tokens: positions, tables and widths differ
        # across the batch, as they do in serving.
        ctx = [args.context + (5 * i) % 11 for i in range(b)]
        window = args.context + 64
        blocks = b * blocks_needed(window + 1, 16) + 8
        runners = {ex: ModelRunner(args.model, ModelConfig(target=args.model, dtype=args.dtype, device=args.device,
                                                           executor=ex if ex in ("native", "transformers")
                                                           else "native",
                                                           cuda_graphs=ex == "graphs", max_model_len=window,
                                                           cuda_graph_query_lens=(1, 5)),
                                   CacheConfig(max_num_seqs=b, num_kv_blocks=blocks), window)
                   for ex in kinds}
        if args.graphs and runners["graphs"].graphs is None:
            from specray.workers.graph_capture import Uncaptured
            from specray.workers.step_graphs import StepGraphs

            r = runners["graphs"]
            if r.graph_failure:
                failures.append(f"batch {b}: CUDA graph capture failed: {r.graph_failure}")
            else:                           # no CUDA: the padded forward, uncaptured
                r.graphs = StepGraphs(r.native, r.kv, b, r.max_model_len, (1, 5), Uncaptured())
                r.graphs.capture_all()
        if args.compiled:
            native = runners["compiled"].native
            native.forward = torch.compile(native.forward, dynamic=True)
        g = torch.Generator().manual_seed(0)
        sids = list(range(b))
        vocab = runners["native"].vocab_size
        toks = torch.randint(0, vocab, (sum(ctx),), generator=g).tolist()
        ends = torch.tensor(ctx).cumsum(0) - 1
        for r in runners.values():
            r.kv.apply(plan(sids, [0] * b, ctx, toks))
            r.forward(sids, [0] * b, ctx, r.to_device(toks), ends.to(r.device))
        for name, q in (("decode", 1), ("verify", 5)):
            times = {ex: [] for ex in runners}
            gdiff = 0.0
            for _ in range(args.repeats):
                # Fresh ids every repeat: a graph replaying stale inputs would differ from eager.
                toks = torch.randint(0, vocab, (b * q,), generator=g).tolist()
                outs = {}
                for ex, r in runners.items():
                    r.kv.apply(plan(sids, ctx, [q] * b, toks))
                    ids, idx = r.to_device(toks), r.to_device(list(range(b * q)))
                    if r.device.type == "cuda":
                        torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    outs[ex] = r.forward(sids, ctx, [q] * b, ids, idx)
                    if r.device.type == "cuda":
                        torch.cuda.synchronize()
                    times[ex].append(time.perf_counter() - t0)
                if "graphs" in outs:
                    gdiff = max(gdiff, (outs["native"] - outs["graphs"]).abs().max().item() /
                                max(outs["native"].abs().max().item(), 1e-6))
            if args.compiled:
                print(f"  (compile of batch {b} {name}: {times['compiled'][0]:.1f} s)")
            nat, hf = (statistics.median(times[e][1:]) * 1e3 for e in ("native", "transformers"))
            diff = (outs["native"] - outs["transformers"]).abs().max().item()
            line = f"{b:>5} {name:>7} {nat:>10.3f} {hf:>8.3f} {hf / nat:>6.2f} {diff:>11.2e}"
            if args.compiled:
                comp = statistics.median(times["compiled"][1:]) * 1e3
                line += f" {comp:>11.3f} {nat / comp:>14.2f}"
            if args.graphs:
                gr = statistics.median(times["graphs"][1:]) * 1e3
                line += f" {gr:>9.3f} {nat / gr:>12.2f} {gdiff:>11.2e}"
                tol = 1e-4 if runners["native"].dtype == torch.float32 else args.graph_tol
                if gdiff > tol:
                    failures.append(f"batch {b} {name}: graphs differ from eager by {gdiff:.2e} of the "
                                    f"largest logit (> {tol:g})")
                if runners["graphs"].graphs is not None and runners["graphs"].graphs.replays == 0:
                    failures.append(f"batch {b} {name}: no step replayed a graph")
            print(line, flush=True)
    for f in failures:
        print("FAIL " + f, flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
