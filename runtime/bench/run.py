"""``specray bench``: specray against plain decoding and Hugging Face on the same models.

All configurations run in one process, interleaved and repeated, so machine noise hits
them alike; medians and the min-max spread are reported. Every greedy configuration must
produce the same tokens for the same prompt, or the run fails: a benchmark of wrong
outputs is worthless.

Without a draft (a target alone, e.g. a real checkpoint with no smaller sibling) the bench
compares specray's prompt lookup (n-gram) and plain decoding with Hugging Face's plain and
prompt-lookup generation; the draft rows, assisted generation and the analytic bound need
a draft and are left out.
"""

from __future__ import annotations

import math
import os
import random
import statistics
import time

import torch

from specray.runtime.bench.hf_runner import HFRunner
from specray.runtime.bench.report import public
from specray.runtime.bench.settings import PHASES, BenchSettings, Run
from specray.runtime.bench.stats import analytic_speedup, batch1_ratios, paired_ratios, within_repeats


class OutputCheck:
    """First greedy output seen for each prompt is the reference for every later one."""

    def __init__(self) -> None:
        self.reference: dict[int, list[int]] = {}
        self.mismatches: list[str] = []

    def check(self, label: str, prompt_ids: list[int], outputs: list[list[int]]) -> None:
        for i, out in zip(prompt_ids, outputs):
            ref = self.reference.setdefault(i, out)
            if out != ref:
                j = next((n for n, (a, b) in enumerate(zip(out, ref)) if a != b), min(len(out), len(ref)))
                self.mismatches.append(f"{label}: prompt {i} differs from the reference at token {j}")


def gpu_shares(s: BenchSettings, spec_configs: list[tuple[str, str, int | None]]) -> dict:
    """RuntimeConfig fields that let every runtime of the bench fit on one GPU. Runs
    interleave, so all runtimes live at once, and a worker on CUDA asks Ray for a whole GPU
    by default: on a one-GPU machine the second runtime would wait for ever. Each actor
    that holds a GPU (a co-located driver, else each draft and target worker) asks for an
    equal part of one instead."""
    from specray.workers.model_loader import resolve_device

    if resolve_device(s.device).type != "cuda":
        return {}
    # A co-located runtime's one process holds the GPU; an actor-layout one's driver
    # (hosting the target) and each draft actor do.
    holders = sum(1 + (p.startswith("draft") and not run_layout(s, pol)[0].startswith("colocated"))
                  for p, pol, _ in spec_configs)
    share = {"GPU": math.floor(100 / holders) / 100}
    return {"target_resources": dict(share), "draft_resources": dict(share)}


def start_runtimes(s: BenchSettings, spec_configs: list[tuple[str, str, int | None]], max_model_len: int) -> dict:
    """(proposer, policy, k) -> a started SpecRuntime (k None: the bench's). The first starts alone (it may start
    Ray), the others together: a start is mostly each actor importing and loading on its
    own, and one after another they took half a minute on two cores.

    ``max_model_len``: what the bench's requests need. Each worker sizes its KV cache for
    every sequence at full length, up to half the GPU's free memory: at a real model's
    window that is the budget, and with every runtime on one GPU each worker would get
    half of what the one before left, the last ones too little for the batch."""
    from concurrent.futures import ThreadPoolExecutor

    from specray import SpecRuntime

    shares = gpu_shares(s, spec_configs)

    def start(proposer: str, policy: str, k: int | None) -> SpecRuntime:
        return SpecRuntime(runtime_config(s, proposer, policy, k, max_model_len, **shares))

    first, rest = spec_configs[0], spec_configs[1:]
    runtimes = {first: start(*first)}
    with ThreadPoolExecutor(max(1, len(rest))) as ex:
        futures = {c: ex.submit(start, *c) for c in rest}
    failures = [f.exception() for f in futures.values() if f.exception() is not None]
    runtimes.update((c, f.result()) for c, f in futures.items() if f.exception() is None)
    if failures:
        for rt in runtimes.values():
            rt.shutdown()
        raise failures[0]
    return runtimes


def runtime_config(s: BenchSettings, proposer: str, policy: str, k: int | None, max_model_len: int | None = None,
                   **resources):
    """The RuntimeConfig of the bench's (proposer, policy, k) runtime (k None: the bench's)."""
    from specray.runtime.config import RuntimeConfig

    layout, threads = run_layout(s, policy)
    policy = policy.partition("@")[0]
    policy, _, plus = policy.partition("+")
    policy, _, variant = policy.partition(":")
    return RuntimeConfig(
        target=s.target, proposer=proposer,
        draft=s.draft if proposer in ("draft", "draft+suffix") else s.head if proposer == "eagle3" else None,
        num_speculative_tokens=s.k if k is None else k, device=s.device, dtype=s.dtype, executor=s.executor,
        block_size=s.block_size, max_num_seqs=max(s.batch_sizes), max_model_len=max_model_len,
        speculation_policy=policy,
        policy_options=dict(s.variants[variant]) if variant else {}, layout=layout.removesuffix("-all-cores"),
        torch_threads=threads if threads > 1 else 0, overlap=plus == "overlap", **resources)


ALL_CORES = "colocated-all-cores"


def layouts(s: BenchSettings) -> list[str]:
    """Every layout the bench runs: the first runs every configuration, the others the
    first draft policy (with co-located among several, also co-located on every core)."""
    out = list(s.layouts) or ["colocated" if s.colocate else "actors"]
    if len(out) > 1 and "colocated" in out and ALL_CORES not in out and (os.cpu_count() or 1) > 1:
        out.append(ALL_CORES)
    return out


def run_layout(s: BenchSettings, policy: str) -> tuple[str, int]:
    """The layout of a specray run's ``policy`` ("static@colocated": that layout; no
    suffix: the bench's first) and its processes' torch threads."""
    layout = policy.partition("@")[2] or layouts(s)[0]
    return layout, (os.cpu_count() or 1) if layout == ALL_CORES else 1


def batch_prompts(num_prompts: int, batch_size: int, rep: int, rotate: bool) -> list[int]:
    """Indices of the held-out prompts a batch of ``batch_size`` serves in repeat ``rep``.

    Without rotation every repeat serves the first ``batch_size``: batch 1 is one text, and
    a policy that learns over the repeats is then measured on how well it fits that text.
    Rotated, repeat ``rep`` serves the ``batch_size`` prompts after the first
    ``rep * batch_size`` (wrapping around), as a server meets new requests."""
    start = rep * batch_size if rotate else 0
    return [(start + i) % num_prompts for i in range(batch_size)]


def prompt_slices(batch_sizes: list[int], repeats: int, rotate: bool) -> tuple[dict[int, int], int]:
    """Where each batch size's prompts start, and how many prompts a bench needs.

    Rotated, every batch size serves prompts of its own (``batch_size * repeats`` of them,
    after the smaller sizes'), and one more prompt, the last, warms the runtimes up: no
    configuration meets a text it or a smaller batch already answered, so a proposer that
    learns from finished requests (suffix decoding) gains only where the prompt set itself
    repeats. Not rotated, every batch size serves the first prompts."""
    if not rotate:
        return {b: 0 for b in batch_sizes}, max(batch_sizes) + 1
    starts, n = {}, 0
    for b in sorted(batch_sizes):
        starts[b] = n
        n += b * repeats
    return starts, n + 1


def run_bench(s: BenchSettings, draft_label: str = "given") -> dict:
    from tqdm import tqdm

    from specray import SamplingParams
    from specray.runtime.bench.prompts import bench_prompts
    from specray.workers.model_loader import load_tokenizer

    # Ray runs actors single-threaded (OMP_NUM_THREADS=1); Hugging Face here gets the same.
    torch.set_num_threads(1)
    tok = load_tokenizer(s.target)
    batch_sizes = sorted(set(s.batch_sizes) | {1})
    starts, num_prompts = prompt_slices(batch_sizes, s.repeats, s.rotate_prompts)
    prompts = bench_prompts(s.prompt_set, num_prompts, tok, s.prompt_bytes)
    warm_up = prompts[-1:]
    hf = HFRunner(s)

    proposers = (("draft",) if s.draft else ()) + (("eagle3",) if s.head else ()) + ("ngram",)
    spec_configs = [(p, pol, None) for p in proposers for pol in s.policies]
    spec_configs += [(p, f"adaptive:{name}", None) for p in proposers for name in s.variants]
    if "static" not in s.policies:
        spec_configs.append(("ngram", "static", None))     # the batch-1 prompt-lookup ratios read it
    if s.draft and s.overlap and not layouts(s)[0].startswith("colocated"):
        spec_configs += [("draft", f"{pol}+overlap", None) for pol in s.policies]
    if s.draft:
        # The first draft policy in every other layout, side by side with the first layout's.
        spec_configs += [("draft", f"{s.policies[0]}@{lay}", None) for lay in layouts(s)[1:]]
    # Suffix decoding, alone and beside the draft, with static proposal lengths.
    spec_configs += [("suffix", "static", None)] + ([("draft+suffix", "static", None)] if s.draft else [])
    spec_configs.append(("none", "static", None))
    sweep = [("draft", "static", k) for k in sorted(set(s.static_ks)) if k != s.k] if s.draft else []
    # Room for the longest prompt, its tokens and the widest step's lookahead past them.
    lookahead = max([s.k, *s.static_ks])
    runtimes = start_runtimes(s, spec_configs + sweep, max(map(len, prompts)) + s.max_tokens + lookahead + 1)
    # One configuration = (system, proposer, batch size, mode, policy, k).
    plan: list[tuple[str, str, int, str, str, int | None]] = []
    # Batch 1 always runs: the analytic bound and the assisted-generation comparison are
    # batch-1 measurements.
    for b in batch_sizes:
        for proposer, policy, k in spec_configs + (sweep if b == 1 else []):
            plan.append(("specray", proposer, b, "greedy", policy, k))
        plan.append(("hf", "none", b, "greedy", "static", None))
    plan.append(("hf", "lookup", 1, "greedy", "static", None))
    if s.draft:
        plan += [("hf", "assisted", 1, "greedy", "static", None), ("hf", "assisted", 1, "sampled", "static", None),
                 ("specray", "draft", 1, "sampled", s.policies[0], None)]
    if s.prompt_set == "repeat":
        # Best-of-n: the same prompt sampled with another seed each repeat.
        plan += [("specray", p, 1, "sampled", "static", None) for p in ("suffix", "ngram", "none")]
    runs = {key: Run(*key) for key in plan}
    for run in runs.values():
        run.overlap = run.policy.partition("@")[0].endswith("+overlap")
        if run.system == "specray":
            run.layout, run.torch_threads = run_layout(s, run.policy)
    check = OutputCheck()
    phase = {"draft_s": [], "verify_none_s": []}
    order_seed = s.order_seed if s.order_seed is not None else random.SystemRandom().getrandbits(32)
    order_rng = random.Random(order_seed)
    try:
        # Warm-up: first calls pay for allocation and lazy initialisation.
        for rt in runtimes.values():
            rt.generate(warm_up * 2, SamplingParams(max_tokens=4, temperature=0.0))
        hf.generate(warm_up, 4, False, 0.0, 0)
        bar = tqdm(total=len(plan) * s.repeats, desc="bench", disable=not s.progress, unit="run")
        for rep in range(s.repeats):
            for key in run_order(plan, order_rng):
                system, proposer, b, mode, policy, k = key
                bar.set_postfix_str(f"{system}/{proposer} b={b} {mode} {policy}" + (f" k={k}" if k else ""))
                run = runs[key]
                served = b * s.repeats if s.rotate_prompts else len(prompts) - 1
                ids = [starts[b] + i for i in batch_prompts(served, b, rep, s.rotate_prompts)]
                batch = [prompts[i] for i in ids]
                temp = s.temperature if mode == "sampled" else 0.0
                if system == "specray":
                    rt = runtimes[(proposer, policy, k)]
                    before = rt.metrics()
                    params = SamplingParams(max_tokens=s.max_tokens, temperature=temp, seed=rep if temp else None)
                    t0 = time.perf_counter()
                    outs = rt.generate(batch, params)
                    dt = time.perf_counter() - t0
                    after = rt.metrics()
                    gen = [o.token_ids for o in outs]
                    run.drafted += after["num_draft_tokens"] - before["num_draft_tokens"]
                    run.accepted += after["num_accepted_tokens"] - before["num_accepted_tokens"]
                    run.emitted += after["num_emitted_tokens"] - before["num_emitted_tokens"]
                    run.seq_steps += after["num_seq_steps"] - before["num_seq_steps"]
                    steps = after["num_steps"] - before["num_steps"]
                    run.steps += steps
                    for key in PHASES.values():
                        run.phase_s[key] = run.phase_s.get(key, 0.0) + after[key] - before[key]
                    run.predrafted += after["num_predrafted_windows"] - before["num_predrafted_windows"]
                    run.predraft_used += after["num_predraft_windows_used"] - before["num_predraft_windows_used"]
                    run.predraft_dropped += (after["num_predraft_windows_dropped"]
                                             - before["num_predraft_windows_dropped"])
                    run.draft_hidden_s += after["draft_hidden_s"] - before["draft_hidden_s"]
                    if b == 1 and mode == "greedy" and k is None and (proposer == "none" or policy == s.policies[0]):
                        if proposer == "draft":
                            calls = after["num_draft_calls"] - before["num_draft_calls"]
                            phase["draft_s"].append((after["draft_s"] - before["draft_s"]) / max(1, calls))
                        if proposer == "eagle3":
                            # The head runs inside the target's verify: its own time, per step.
                            phase.setdefault("eagle3_s", []).append(
                                (head_s(after) - head_s(before)) / max(1, steps))
                        if proposer == "none":
                            phase["verify_none_s"].append((after["verify_s"] - before["verify_s"]) / max(1, steps))
                else:
                    gen, dt, calls = hf.generate(batch, s.max_tokens, proposer == "assisted", temp, rep,
                                                 lookup=proposer == "lookup")
                    if proposer in ("assisted", "lookup"):
                        # Each target call scores one round: emitted tokens per round.
                        run.emitted += len(gen[0])
                        run.seq_steps += max(1, calls - 1)
                run.samples.append(sum(len(g) for g in gen) / dt)
                if mode == "greedy":
                    check.check(f"{system}/{run.label}/b{b}", ids, gen)
                bar.update(1)
        bar.close()
        # Whether the timed steps replayed CUDA graphs, per runtime and worker.
        graphs = {"/".join(str(x) for x in key if x is not None): graph_figures(rt.metrics())
                  for key, rt in runtimes.items()}
    finally:
        for rt in runtimes.values():
            rt.shutdown()

    for run in runs.values():
        # Assisted generation's and prompt lookup's acceptance is not observable from
        # outside; their mean accepted length is tokens per target forward call.
        run.finish()
    none1 = runs[("specray", "none", 1, "greedy", "static", None)]
    alpha = c = bound = speedup = None
    if s.draft:
        spec1 = runs[("specray", "draft", 1, "greedy", s.policies[0], None)]
        alpha = spec1.acceptance_rate or 0.0
        c = statistics.median(phase["draft_s"]) / s.k / statistics.median(phase["verify_none_s"])
        bound = analytic_speedup(alpha, c, s.k)
        speedup = spec1.tokens_per_s / none1.tokens_per_s
    eagle3 = eagle3_figures(s, runs, phase) if s.head else None
    result = {
        "k": s.k, "alpha": alpha, "c": c, "analytic_bound": bound, "measured_speedup": speedup,
        "efficiency": speedup / bound if s.draft else None, "greedy_outputs_equal": not check.mismatches,
        "mismatches": check.mismatches[:20], "max_tokens": s.max_tokens, "repeats": s.repeats,
        "rotate_prompts": s.rotate_prompts, "order_seed": order_seed, "static_ks": sorted(set(s.static_ks) - {s.k}),
        "colocate": s.colocate, "layouts": layouts(s),
        "torch_threads": torch.get_num_threads(),
        "device": str(hf.device), "target": s.target, "draft": s.draft, "draft_label": draft_label,
        "prompt_set": s.prompt_set,
        "runs": [public(r) for r in runs.values()],
        "paired": paired_ratios(list(runs.values())),
        "batch1_ratios": batch1_ratios(runs),
        "graphs": graphs,
        "eagle3": eagle3,
    }
    return result


def head_s(metrics: dict) -> float:
    """The EAGLE-3 heads' own compute so far (s), summed over the target workers."""
    return sum((g or {}).get("head_compute_s", 0.0) for g in metrics.get("worker_graphs") or [])


def eagle3_figures(s: BenchSettings, runs: dict, phase: dict) -> dict:
    """What limits the EAGLE-3 head beside the draft model, at batch 1 (greedy, the
    first policy) and at every batch size: acceptance, mean accepted length, tokens/s
    against the draft's (within repeats), the head's own time per step (its proposals
    and its rebuild from the target's states, both inside the verify call) per proposal
    as a fraction of a plain target step (c, as the draft's) and the analytic bound those
    give."""
    out: dict = {"by_batch": {}}
    none1 = runs[("specray", "none", 1, "greedy", "static", None)]
    for b in sorted({r.batch_size for r in runs.values()}):
        e = runs.get(("specray", "eagle3", b, "greedy", s.policies[0], None))
        d = runs.get(("specray", "draft", b, "greedy", s.policies[0], None))
        if e is None:
            continue
        row = {"acceptance_rate": e.acceptance_rate, "mean_accepted_length": e.mean_accepted_length,
               "tokens_per_s": e.tokens_per_s}
        if d is not None:
            row.update(draft_mean_accepted_length=d.mean_accepted_length, draft_tokens_per_s=d.tokens_per_s,
                       tokens_per_s_over_draft=within_repeats(e.samples, d.samples))
        out["by_batch"][b] = row
    if phase.get("eagle3_s") and phase["verify_none_s"]:
        e1 = runs[("specray", "eagle3", 1, "greedy", s.policies[0], None)]
        c = statistics.median(phase["eagle3_s"]) / s.k / statistics.median(phase["verify_none_s"])
        bound = analytic_speedup(e1.acceptance_rate or 0.0, c, s.k)
        out.update(alpha=e1.acceptance_rate, c=c, analytic_bound=bound,
                   measured_speedup=e1.tokens_per_s / none1.tokens_per_s)
    if phase.get("draft_s"):
        out["draft_c"] = statistics.median(phase["draft_s"]) / s.k / statistics.median(phase["verify_none_s"])
    return out


GRAPH_FIGURES = ("graph_replays", "eager_forwards", "graph_capture_failures", "worker_graphs")


def graph_figures(metrics: dict) -> dict:
    """The CUDA graph part of a runtime's ``metrics()``."""
    return {k: metrics[k] for k in GRAPH_FIGURES if k in metrics}


def run_order(plan: list[tuple], rng: random.Random) -> list[tuple]:
    """The plan for one repeat: batch sizes in order, the configurations of each in an
    order drawn afresh. A configuration's place in the order moves its figure: two
    identical runtimes rotated one place per repeat differed by up to 18 %, in the same
    direction over eight fresh runs (each run repeated the same places;
    docs/adaptive-policy.md). Drawn orders make that noise, which repeats and runs
    average, instead of a bias they keep."""
    out: list[tuple] = []
    for b in dict.fromkeys(key[2] for key in plan):
        group = [key for key in plan if key[2] == b]
        rng.shuffle(group)
        out += group
    return out


def rotated(items: list, rep: int) -> list:
    shift = rep % len(items)
    return items[shift:] + items[:shift]
