"""Command-line flags shared by ``specray generate``, ``serve``, ``batch`` and ``bench``."""

from __future__ import annotations

import argparse
import json


def builtin_model(name: str) -> str | None:
    """Path of a model of the built-in pair (``tiny-target``, ``tiny-draft``), or None
    where it is not installed (the commands then ask for ``--target``)."""
    from specray.model_store import ModelNotFound
    from specray.model_store import builtin_model as find

    try:
        return find(name)
    except ModelNotFound:
        return None


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default=None, help="target model dir or hub id (default: the built-in pair)")
    p.add_argument("--draft", default=None, help="draft model dir or hub id (default: the built-in pair)")
    p.add_argument("--proposer", default="draft", choices=["draft", "ngram", "none"])
    p.add_argument("-k", "--num-speculative-tokens", type=int, default=4)
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--dtype", default="auto")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-kv-blocks", type=int, default=None)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-pending", type=int, default=4096,
                   help="unfinished requests the driver holds; submits past it are refused (Overloaded)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--policy", default="static", choices=["static", "adaptive"],
                   help="speculation policy: fixed k, or per-sequence k_i chosen for goodput")
    p.add_argument("--disable-by-batch-size", type=int, default=None)
    p.add_argument("--no-draft-early-stop", dest="draft_early_stop", action="store_false",
                   help="with --policy adaptive: a request alone proposes its whole k_i (no early stops)")
    p.add_argument("--max-speculative-tokens", type=int, default=None,
                   help="with --policy adaptive: a request alone proposes up to this many, its draft "
                        "stopping early (default: twice -k)")
    p.add_argument("--colocate", action="store_true",
                   help="run draft and target inside the driver's actor (one process, no hops per step)")
    p.add_argument("--compiled-graph", action="store_true",
                   help="driver <-> worker steps over Ray Compiled Graph channels instead of actor calls")
    p.add_argument("--num-draft-workers", type=int, default=1)
    p.add_argument("--num-target-workers", type=int, default=1)
    p.add_argument("--draft-resources", type=json.loads, default={},
                   help='JSON, e.g. \'{"specray_draft": 1}\'')
    p.add_argument("--target-resources", type=json.loads, default={},
                   help='JSON, e.g. \'{"specray_target": 1}\'')
    p.add_argument("--placement-strategy", default="SPREAD", choices=["SPREAD", "PACK", "STRICT_SPREAD", "STRICT_PACK"])
    p.add_argument("--placement-timeout", type=float, default=300.0,
                   help="seconds to wait for the cluster (or its autoscaler) to place every worker")
    p.add_argument("--ray-address", default=None,
                   help="cluster to join (default: this process's Ray, else RAY_ADDRESS, else a private local Ray)")


def runtime_config(args, **extra):
    """A RuntimeConfig from ``add_model_args`` flags; the built-in pair fills in models."""
    from specray.config import RuntimeConfig

    target = args.target or builtin_model("tiny-target")
    if target is None:
        raise ValueError("no --target given and the built-in pair is missing under models/")
    draft = None
    if args.proposer == "draft":
        draft = args.draft or (builtin_model("tiny-draft") if args.target is None else None)
        if draft is None:
            raise ValueError("--proposer draft needs --draft")
    return RuntimeConfig(
        target=target, draft=draft, proposer=args.proposer, num_speculative_tokens=args.num_speculative_tokens,
        device=args.device, dtype=args.dtype, block_size=args.block_size, num_kv_blocks=args.num_kv_blocks,
        max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs, max_pending=args.max_pending, seed=args.seed,
        num_draft_workers=args.num_draft_workers, num_target_workers=args.num_target_workers,
        draft_resources=args.draft_resources, target_resources=args.target_resources,
        placement_strategy=args.placement_strategy, placement_timeout_s=args.placement_timeout,
        ray_address=args.ray_address,
        speculation_policy=args.policy, disable_by_batch_size=args.disable_by_batch_size,
        draft_early_stop=args.draft_early_stop, max_speculative_tokens=args.max_speculative_tokens,
        colocate=args.colocate,
        compiled_graph=args.compiled_graph, **extra)
