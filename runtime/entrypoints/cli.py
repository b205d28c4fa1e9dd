"""The ``specray`` command."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import time

from specray.runtime.entrypoints import models_cli, serve
from specray.runtime.entrypoints.batch import job as batch
from specray.runtime.entrypoints.cli_args import add_model_args, installed_builtin, runtime_config, sampling_default


def cmd_generate(args) -> int:
    from specray import SamplingParams, SpecRuntime

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k, seed=args.sample_seed)
    rt = SpecRuntime(runtime_config(args))
    try:
        t0 = time.perf_counter()
        pieces = []
        print(args.prompt, end="", flush=True)
        for delta in rt.stream(args.prompt, params):
            print(delta.text, end="", flush=True)
            pieces.append(delta)
        elapsed = time.perf_counter() - t0
        m = rt.metrics()
    finally:
        rt.shutdown()
    n = sum(len(d.token_ids) for d in pieces)
    print()
    print(f"\n[specray] {n} tokens in {elapsed:.2f}s ({n / elapsed:.1f} tokens/s, includes the first step's "
          f"prefill); finish_reason={pieces[-1].finish_reason if pieces else None}")
    print(f"[specray] proposer={m['proposer']} num_speculative_tokens={m['num_speculative_tokens']} "
          f"acceptance_rate={m['acceptance_rate']:.3f} mean_accepted_length={m['mean_accepted_length']:.2f} "
          f"system_efficiency={m['system_efficiency']:.3f} decode tokens/s={m['tokens_per_s']:.1f}")
    return 0


def cmd_bench_chat(args, target: str, draft: str | None) -> int:
    """``--prompts chat``: the draft model where there is one, else n-gram lookup."""
    from statistics import median

    from specray.runtime.bench.chat import bench_chat
    from specray.runtime.config import RuntimeConfig
    from specray.workers import model_loader

    proposer = "draft" if draft else "ngram"
    cfg = RuntimeConfig(target=target, draft=draft, proposer=proposer,
                        num_speculative_tokens=args.num_speculative_tokens, device=args.device, dtype=args.dtype,
                        executor=args.executor,
                        layout="colocated" if args.colocate else "auto")
    repeats = min(args.repeats, 2) if args.quick else args.repeats
    max_tokens = min(args.max_tokens, 32) if args.quick else args.max_tokens
    result = bench_chat(cfg, model_loader.load_tokenizer(target), args.conversations, args.concurrency,
                        max_tokens, repeats)
    print(f"chat: {proposer}, {args.conversations} conversations, concurrency {args.concurrency}, "
          f"{max_tokens} tokens an answer, median of {repeats}")
    for name, runs in result.items():
        m = {k: median([r[k] for r in runs]) for k in runs[0]}
        print(f"  {name:12s} ttft p50 {m['ttft_p50_ms']:8.1f} ms  p99 {m['ttft_p99_ms']:8.1f} ms  "
              f"{m['tokens_per_s']:8.1f} tok/s  acceptance {m['acceptance_rate']:.3f}  "
              f"hit rate {m['prefix_cache_hit_rate']:.3f}")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "chat.json"), "w") as f:
        json.dump(dict(proposer=proposer, target=target, draft=draft, concurrency=args.concurrency,
                       conversations=args.conversations, max_tokens=max_tokens, runs=result), f, indent=1)
    return 0


def cmd_bench(args) -> int:
    from specray.runtime.bench.hf_runner import random_copy
    from specray.runtime.bench.report import format_table, write_outputs
    from specray.runtime.bench.run import run_bench
    from specray.runtime.bench.settings import BenchSettings

    target = args.target or installed_builtin("tiny-target")
    # A target given alone is benched without a draft: n-gram and plain decoding only.
    draft = args.draft or (installed_builtin("tiny-draft") if args.target is None else None)
    if target is None or (args.target is None and draft is None):
        raise SystemExit("bench needs --target (and --draft, for the draft runs), or the built-in pair")
    if args.random_draft and draft is None:
        raise SystemExit("--random-draft needs a draft to copy: give --draft")
    if args.prompts == "chat":
        return cmd_bench_chat(args, target, draft)
    sizes = tuple(int(x) for x in args.batch_sizes.split(","))
    if args.workload == "json":
        return _bench_json(args, target, draft, sizes)
    # eagle3 runs beside the others wherever a head is there: the built-in target's always.
    head = args.head or (installed_builtin("tiny-eagle3") if args.target is None else None)
    s = BenchSettings(target=target, draft=draft, head=head, k=args.num_speculative_tokens, batch_sizes=sizes,
                      max_tokens=args.max_tokens, repeats=args.repeats, temperature=args.temperature,
                      device=args.device, dtype=args.dtype, out_dir=args.out, colocate=args.colocate,
                      rotate_prompts=args.rotate_prompts,
                      static_ks=tuple(int(x) for x in args.static_k.split(",") if x.strip()),
                      prompt_set=args.prompts, executor=args.executor, overlap=args.overlap,
                      layouts=tuple(x.strip() for x in args.layouts.split(",") if x.strip()))
    bad = [x for x in s.layouts if x not in ("actors", "colocated")]
    if bad or (args.colocate and s.layouts):
        raise ValueError(f"--layouts takes actors and colocated (not with --colocate), got {args.layouts!r}")
    s.policies = ("static", "adaptive") if args.policy == "both" else (args.policy,)
    for spec in args.adaptive_variant:
        name, _, options = spec.partition("=")
        if not name or ":" in name or "adaptive" not in s.policies:
            raise ValueError(f"--adaptive-variant {spec!r}: give NAME=JSON, with --policy adaptive or both")
        s.variants[name] = json.loads(options or "{}")
    if args.quick:
        s.max_tokens, s.repeats = min(s.max_tokens, 32), min(s.repeats, 2)
    label = "built-in" if args.draft is None and args.target is None else "given" if draft else "no"
    with tempfile.TemporaryDirectory() as tmp:
        if args.random_draft:
            s.draft, label = random_copy(draft, tmp), "random (bad)"
        result = run_bench(s, label)
    jpath, ppath = write_outputs(result, s.out_dir)
    print(format_table(result))
    print(f"wrote {jpath}" + (f" and {ppath}" if ppath else ""))
    if not result["greedy_outputs_equal"]:
        print("specray bench: greedy outputs differ between configurations:", file=sys.stderr)
        for m in result["mismatches"]:
            print("  " + m, file=sys.stderr)
        return 1
    return 0


def _bench_json(args, target: str, draft: str | None, sizes: tuple[int, ...]) -> int:
    """``specray bench --workload json`` (``specray.runtime.bench.json_workload``)."""
    from specray.runtime.bench.json_workload import format_json_table, run_json_bench, write_json_result
    from specray.runtime.config import RuntimeConfig

    cfg = RuntimeConfig(target=target, draft=draft, proposer="draft" if draft else "ngram",
                        num_speculative_tokens=args.num_speculative_tokens, device=args.device, dtype=args.dtype,
                        executor=args.executor, layout="colocated" if args.colocate else "auto")
    max_tokens, repeats = (min(args.max_tokens, 32), min(args.repeats, 2)) if args.quick else (args.max_tokens,
                                                                                               args.repeats)
    result = run_json_bench(cfg, sizes, max_tokens, repeats, args.temperature)
    print(format_json_table(result))
    print(f"wrote {write_json_result(result, args.out)}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specray", description="Exact speculative decoding on Ray")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate a continuation of one prompt")
    g.add_argument("prompt")
    add_model_args(g)
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=sampling_default("temperature"),
                   help="0 for greedy (the built-in pair, being tiny, then repeats whitespace); default: "
                        "SamplingParams', %(default)s")
    g.add_argument("--top-p", type=float, default=sampling_default("top_p"))
    g.add_argument("--top-k", type=int, default=sampling_default("top_k"))
    g.add_argument("--sample-seed", type=int, default=None)
    g.set_defaults(func=cmd_generate)
    b = sub.add_parser("bench", help="speedup over plain decoding and Hugging Face on the same models")
    add_model_args(b, only=("target", "draft", "num_speculative_tokens", "device", "dtype", "executor"))
    b.add_argument("--colocate", action="store_true", help="specray's workers inside the driver's process "
                   "(--layouts colocated)")
    b.add_argument("--layouts", default="",
                   help="comma-separated layouts (actors, colocated), side by side: every configuration runs in "
                        "the first, the draft in the others too (with colocated, also co-located on every core); "
                        "JSON: \"layout\" and \"torch_threads\" on each run (default: actors, or colocated with "
                        "--colocate)")
    b.add_argument("--batch-sizes", default="1,8,32",
                   help="comma-separated; batch 1 always runs (the analytic bound needs it)")
    b.add_argument("--max-tokens", type=int, default=64)
    b.add_argument("--repeats", type=int, default=3)
    b.add_argument("--temperature", type=float, default=0.8, help="for the sampled runs")
    b.add_argument("--out", default="bench_out")
    b.add_argument("--quick", action="store_true", help="fewer tokens and repeats (about a minute on a CPU)")
    b.add_argument("--policy", default="static", choices=["static", "adaptive", "both"],
                   help="speculation policy of the draft runs")
    b.add_argument("--rotate-prompts", action="store_true",
                   help="each repeat serves the next held-out prompts (batch 1: a new text every repeat), each "
                        "batch size prompts of its own, instead of the same ones")
    b.add_argument("--static-k", default="",
                   help="more fixed k's for the draft at batch 1, e.g. 6,8: adaptive is held to the best of them")
    b.add_argument("--adaptive-variant", action="append", default=[], metavar="NAME=JSON",
                   help="another adaptive runtime with these policy_options beside the adaptive one, e.g. "
                        "lean='{\"shrinkage\": 4}' (with --policy adaptive or both)")
    b.add_argument("--prompts", default="code", choices=["code", "quote", "mixed", "repeat", "chat"],
                   help="code: held-out standard-library snippets to continue; quote: requests to rewrite a "
                        "paragraph the prompt quotes (where n-gram lookup pays); mixed: the two alternating; "
                        "repeat: each code prompt asked four times in a row (where suffix decoding pays); chat: "
                        "multi-turn conversations after a shared 400-token system prompt, each turn's prompt the "
                        "whole conversation, served with prefix caching on and off (TTFT, tokens/s, acceptance)")
    b.add_argument("--concurrency", type=int, default=8, help="--prompts chat: conversations at once")
    b.add_argument("--conversations", type=int, default=16, help="--prompts chat: conversations per repeat")
    b.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=True,
                   help="beside each draft policy's runs, the same with overlap on (its draft actors pre-draft "
                        "while the target verifies); JSON: \"overlap\" on each run")
    b.add_argument("--head", default=None,
                   help="an EAGLE-3 head for the target (default: tiny-eagle3 with the built-in target): eagle3 runs "
                        "beside the other proposers")
    b.add_argument("--workload", default="text", choices=["text", "json"],
                   help="text: the comparison above; json: the same requests with a JSON-schema grammar off and "
                        "on, side by side (tokens/s, acceptance, mask time per step; docs/structured-output.md)")
    b.add_argument("--random-draft", action="store_true",
                   help="replace the draft's weights with random ones: a deliberately bad draft")
    b.set_defaults(func=cmd_bench)
    serve.add_parser(sub)
    batch.add_parser(sub)
    models_cli.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # The runtime's own lines (which layout it chose and why) reach the terminal.
    log = logging.getLogger("specray")
    if not log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[specray] %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
    try:
        return args.func(args)
    except ValueError as e:
        print(f"specray: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        # Each command releases its runtime in a finally block on the way here.
        print("\nspecray: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
