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

import json
import math
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from specray.scheduler.config import CacheConfig, SpeculationConfig
from specray.workers.worker_config import ModelConfig


@dataclass
class BenchSettings:
    target: str
    draft: str | None                 # None: no draft runs (n-gram and plain decoding only)
    k: int = SpeculationConfig.num_speculative_tokens
    batch_sizes: tuple[int, ...] = (1, 8, 32)
    max_tokens: int = 64
    repeats: int = 3
    temperature: float = 0.8          # for the sampled runs
    device: str = ModelConfig.device
    dtype: str = ModelConfig.dtype
    executor: str = ModelConfig.executor      # specray's forward path (native or transformers)
    out_dir: str = "bench_out"
    prompt_bytes: int = 160
    block_size: int = CacheConfig.block_size
    progress: bool = True
    policies: tuple[str, ...] = ("static",)   # speculation policies of the specray draft and n-gram runs
    colocate: bool = False                    # specray's workers inside the driver's process
    compiled_graph: bool = False              # driver <-> worker steps over compiled graph channels
    # Each repeat's batch of b takes the next b held-out prompts, so batch 1 meets a new
    # text every repeat (see ``batch_prompts``).
    rotate_prompts: bool = False
    draft_early_stop: bool = True             # the adaptive draft runs' drafts stop early at batch 1
    max_speculative_tokens: int | None = None # the adaptive runs' cap for a request alone (None: 2 k)
    # More fixed k's for the draft at batch 1, where adaptive is held to the best of them.
    static_ks: tuple[int, ...] = ()
    # Adaptive policies with other options (name -> policy_options), run beside the
    # adaptive one at every batch size: each mechanism's worth, measured side by side.
    variants: dict[str, dict] = field(default_factory=dict)
    prompt_set: str = "code"                  # bench_prompts.PROMPT_SETS
    # Each draft policy also runs with overlap on (policy "<name>+overlap"), side by side
    # with it off; not co-located (overlap needs draft actors of their own).
    overlap: bool = True


SPECULATING = ("draft", "ngram")      # the proposers whose runs take a speculation policy

# Step-time breakdown: name in the report -> metrics() counter; together they make up a step.
PHASES = {"schedule": "schedule_s", "draft": "draft_compute_s", "merge": "merge_s",
          "verify": "verify_compute_s", "messaging": "messaging_s", "driver": "driver_overhead_s"}


@dataclass
class Run:
    system: str                        # "specray" | "hf"
    proposer: str                      # "draft" | "ngram" | "none" | "assisted" | "lookup" (HF prompt lookup)
    batch_size: int
    mode: str = "greedy"               # "greedy" | "sampled"
    policy: str = "static"
    k: int | None = None               # an extra static run's fixed k (static_ks); None: the bench's k
    tokens_per_s: float = 0.0
    tokens_per_s_min: float = 0.0
    tokens_per_s_max: float = 0.0
    acceptance_rate: float | None = None
    mean_accepted_length: float | None = None
    samples: list[float] = field(default_factory=list)
    accepted: int = 0
    drafted: int = 0
    emitted: int = 0
    seq_steps: int = 0
    steps: int = 0
    phase_s: dict[str, float] = field(default_factory=dict)
    # Per step (specray runs): where the time went, in ms; ``overhead`` is everything but
    # the workers' own compute.
    step_ms: dict[str, float] | None = None
    overlap: bool = False              # draft actors pre-draft while the target verifies
    # Overlap runs: windows pre-drafted, taken and dropped, and the draft time that ran
    # behind verification, over all repeats.
    predrafted: int = 0
    predraft_used: int = 0
    predraft_dropped: int = 0
    draft_hidden_s: float = 0.0

    @property
    def key(self) -> tuple:
        return (self.system, self.proposer, self.batch_size, self.mode, self.policy, self.k)

    @property
    def label(self) -> str:
        return (self.proposer + (f"/{self.policy}" if self.proposer in SPECULATING else "")
                + (f"/k{self.k}" if self.k is not None else ""))

    def finish(self) -> None:
        self.tokens_per_s = statistics.median(self.samples)
        self.tokens_per_s_min, self.tokens_per_s_max = min(self.samples), max(self.samples)
        if self.drafted:
            self.acceptance_rate = self.accepted / self.drafted
        if self.seq_steps:
            self.mean_accepted_length = self.emitted / self.seq_steps
        if self.steps:
            ms = {name: self.phase_s[key] / self.steps * 1e3 for name, key in PHASES.items()}
            ms["step"] = sum(ms.values())
            ms["overhead"] = ms["step"] - ms["draft"] - ms["verify"]
            self.step_ms = ms


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


def analytic_speedup(alpha: float, c: float, k: int) -> float:
    """Expected speedup of speculative decoding: (1 - a^(k+1)) / ((1 - a)(c k + 1))."""
    if alpha >= 1.0:
        return (k + 1) / (c * k + 1)
    return (1 - alpha ** (k + 1)) / ((1 - alpha) * (c * k + 1))


def _strip(tokens: list[int], eos: set[int], pad: int | None) -> list[int]:
    out = []
    for t in tokens:
        out.append(t)
        if t in eos:
            break
    return out


class HFRunner:
    """transformers' generate: the target alone (padded batches), assisted generation (with
    a draft) and prompt lookup (``prompt_lookup_num_tokens = k``, batch 1)."""

    def __init__(self, s: BenchSettings):
        from transformers import AutoModelForCausalLM

        from specray.workers.model_loader import resolve_device, resolve_dtype, load_config

        self.device = resolve_device(s.device)
        dtype = resolve_dtype(s.dtype, self.device, load_config(s.target))
        self.target = AutoModelForCausalLM.from_pretrained(s.target, dtype=dtype).to(self.device).eval()
        self.draft = AutoModelForCausalLM.from_pretrained(s.draft, dtype=dtype).to(self.device).eval() \
            if s.draft else None
        eos = self.target.generation_config.eos_token_id
        self.eos = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        self.pad = self.target.generation_config.pad_token_id
        if self.pad is None:
            self.pad = 0
        self.calls = 0
        self.target.register_forward_pre_hook(self._count)
        self.k = s.k

    def _count(self, *_):
        self.calls += 1

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], max_tokens: int, assisted: bool, temperature: float,
                 seed: int, lookup: bool = False) -> tuple[list[list[int]], float, int]:
        n = len(prompts)
        width = max(len(p) for p in prompts)
        ids = torch.full((n, width), self.pad, dtype=torch.long)
        mask = torch.zeros((n, width), dtype=torch.long)
        for i, p in enumerate(prompts):       # left padding, as generate expects
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        kw = dict(max_new_tokens=max_tokens, pad_token_id=self.pad)
        if temperature > 0:
            kw.update(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
            torch.manual_seed(seed)
        else:
            kw.update(do_sample=False)
        if assisted:
            self.draft.generation_config.num_assistant_tokens = self.k
            self.draft.generation_config.num_assistant_tokens_schedule = "constant"
            self.draft.generation_config.assistant_confidence_threshold = 0.0
            kw.update(assistant_model=self.draft)
        if lookup:
            kw.update(prompt_lookup_num_tokens=self.k)
        self.calls = 0
        _sync(self.device)
        t0 = time.perf_counter()
        out = self.target.generate(ids.to(self.device), attention_mask=mask.to(self.device), **kw)
        _sync(self.device)
        dt = time.perf_counter() - t0
        gen = [_strip(row[width:].tolist(), self.eos, self.pad) for row in out.cpu()]
        return gen, dt, self.calls


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def random_copy(model_dir: str, out_dir: str, seed: int = 0) -> str:
    """The same architecture with freshly initialised weights: a deliberately bad draft."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    model.save_pretrained(out_dir)
    return out_dir


def gpu_shares(s: BenchSettings, spec_configs: list[tuple[str, str, int | None]]) -> dict:
    """RuntimeConfig fields that let every runtime of the bench fit on one GPU. Runs
    interleave, so all runtimes live at once, and a worker on CUDA asks Ray for a whole GPU
    by default: on a one-GPU machine the second runtime would wait for ever. Each actor
    that holds a GPU (a co-located driver, else each draft and target worker) asks for an
    equal part of one instead."""
    from specray.workers.model_loader import resolve_device

    if resolve_device(s.device).type != "cuda":
        return {}
    holders = len(spec_configs) if s.colocate else sum(1 + (p == "draft") for p, *_ in spec_configs)
    share = {"GPU": math.floor(100 / holders) / 100}
    return {"target_resources": dict(share), "draft_resources": dict(share)}


def _start_runtimes(s: BenchSettings, spec_configs: list[tuple[str, str, int | None]], max_model_len: int) -> dict:
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
    from specray.config import RuntimeConfig

    policy, _, plus = policy.partition("+")
    policy, _, variant = policy.partition(":")
    options = dict(s.variants[variant]) if variant else {}
    # A variant may switch the early stops off as an option of its own.
    stops = options.pop("stop_early", True) and s.draft_early_stop and proposer == "draft" and policy == "adaptive"
    return RuntimeConfig(
        target=s.target, draft=s.draft if proposer == "draft" else None, proposer=proposer,
        num_speculative_tokens=s.k if k is None else k, device=s.device, dtype=s.dtype, executor=s.executor,
        block_size=s.block_size, max_num_seqs=max(s.batch_sizes), max_model_len=max_model_len, speculation_policy=policy,
        draft_early_stop=stops, max_speculative_tokens=options.pop("max_speculative_tokens", s.max_speculative_tokens)
        if stops else None, policy_options=options, colocate=s.colocate, compiled_graph=s.compiled_graph,
        overlap=plus == "overlap", **resources)


def batch_prompts(num_prompts: int, batch_size: int, rep: int, rotate: bool) -> list[int]:
    """Indices of the held-out prompts a batch of ``batch_size`` serves in repeat ``rep``.

    Without rotation every repeat serves the first ``batch_size``: batch 1 is one text, and
    a policy that learns over the repeats is then measured on how well it fits that text.
    Rotated, repeat ``rep`` serves the ``batch_size`` prompts after the first
    ``rep * batch_size`` (wrapping around), as a server meets new requests."""
    start = rep * batch_size if rotate else 0
    return [(start + i) % num_prompts for i in range(batch_size)]


def run_bench(s: BenchSettings, draft_label: str = "given") -> dict:
    from tqdm import tqdm

    from specray import SamplingParams
    from specray.bench_prompts import bench_prompts
    from specray.workers.model_loader import load_tokenizer

    # Ray runs actors single-threaded (OMP_NUM_THREADS=1); Hugging Face here gets the same.
    torch.set_num_threads(1)
    tok = load_tokenizer(s.target)
    prompts = bench_prompts(s.prompt_set, max(s.batch_sizes) * (s.repeats if s.rotate_prompts else 1), tok,
                            s.prompt_bytes)
    hf = HFRunner(s)

    proposers = ("draft", "ngram") if s.draft else ("ngram",)
    spec_configs = [(p, pol, None) for p in proposers for pol in s.policies]
    spec_configs += [(p, f"adaptive:{name}", None) for p in proposers for name in s.variants]
    if "static" not in s.policies:
        spec_configs.append(("ngram", "static", None))     # the batch-1 prompt-lookup ratios read it
    if s.draft and s.overlap and not s.colocate and not s.compiled_graph:
        spec_configs += [("draft", f"{pol}+overlap", None) for pol in s.policies]
    spec_configs.append(("none", "static", None))
    sweep = [("draft", "static", k) for k in sorted(set(s.static_ks)) if k != s.k] if s.draft else []
    # Room for the longest prompt, its tokens and the widest step's lookahead past them.
    lookahead = max(runtime_config(s, *c).lookahead for c in spec_configs + sweep)
    runtimes = _start_runtimes(s, spec_configs + sweep, max(map(len, prompts)) + s.max_tokens + lookahead + 1)
    # One configuration = (system, proposer, batch size, mode, policy, k).
    plan: list[tuple[str, str, int, str, str, int | None]] = []
    # Batch 1 always runs: the analytic bound and the assisted-generation comparison are
    # batch-1 measurements.
    for b in sorted(set(s.batch_sizes) | {1}):
        for proposer, policy, k in spec_configs + (sweep if b == 1 else []):
            plan.append(("specray", proposer, b, "greedy", policy, k))
        plan.append(("hf", "none", b, "greedy", "static", None))
    plan.append(("hf", "lookup", 1, "greedy", "static", None))
    if s.draft:
        plan += [("hf", "assisted", 1, "greedy", "static", None), ("hf", "assisted", 1, "sampled", "static", None),
                 ("specray", "draft", 1, "sampled", s.policies[0], None)]
    runs = {key: Run(*key) for key in plan}
    for run in runs.values():
        run.overlap = run.policy.endswith("+overlap")
    check = OutputCheck()
    phase = {"draft_s": [], "verify_none_s": []}
    try:
        # Warm-up: first calls pay for allocation and lazy initialisation.
        for rt in runtimes.values():
            rt.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0.0))
        hf.generate(prompts[:1], 4, False, 0.0, 0)
        bar = tqdm(total=len(plan) * s.repeats, desc="bench", disable=not s.progress, unit="run")
        for rep in range(s.repeats):
            for key in run_order(plan, rep):
                system, proposer, b, mode, policy, k = key
                bar.set_postfix_str(f"{system}/{proposer} b={b} {mode} {policy}" + (f" k={k}" if k else ""))
                run = runs[key]
                ids = batch_prompts(len(prompts), b, rep, s.rotate_prompts)
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
    result = {
        "k": s.k, "alpha": alpha, "c": c, "analytic_bound": bound, "measured_speedup": speedup,
        "efficiency": speedup / bound if s.draft else None, "greedy_outputs_equal": not check.mismatches,
        "mismatches": check.mismatches[:20], "max_tokens": s.max_tokens, "repeats": s.repeats,
        "rotate_prompts": s.rotate_prompts, "static_ks": sorted(set(s.static_ks) - {s.k}),
        # The adaptive runs' reach alone (None: no adaptive runs, or no early stops).
        "max_speculative_tokens": runtime_config(s, "draft", "adaptive", None).lookahead if "adaptive" in s.policies
        else None,
        "colocate": s.colocate, "compiled_graph": s.compiled_graph, "torch_threads": torch.get_num_threads(),
        "device": str(hf.device), "target": s.target, "draft": s.draft, "draft_label": draft_label,
        "prompt_set": s.prompt_set,
        "runs": [_public(r) for r in runs.values()],
        "paired": paired_ratios(list(runs.values())),
        "batch1_ratios": batch1_ratios(runs),
    }
    return result


# (numerator, denominator) at batch 1, greedy: what prompt lookup buys in each system, and
# specray against Hugging Face.
BATCH1_RATIOS = {
    "specray ngram / specray none": (("specray", "ngram"), ("specray", "none")),
    "hf lookup / hf none": (("hf", "lookup"), ("hf", "none")),
    "specray ngram / hf none": (("specray", "ngram"), ("hf", "none")),
    "specray ngram / hf lookup": (("specray", "ngram"), ("hf", "lookup")),
    "specray none / hf none": (("specray", "none"), ("hf", "none")),
}


def batch1_ratios(runs: dict) -> dict:
    """``BATCH1_RATIOS`` within each repeat (``within_repeats``)."""
    def samples(system: str, proposer: str) -> list[float]:
        return runs[(system, proposer, 1, "greedy", "static", None)].samples

    out = {name: within_repeats(samples(*a), samples(*b)) for name, (a, b) in BATCH1_RATIOS.items()}
    # Overlap against the serial draft and against assisted generation, where both ran.
    keys = {"draft": ("specray", "draft", 1, "greedy", "static", None),
            "draft+overlap": ("specray", "draft", 1, "greedy", "static+overlap", None),
            "hf assisted": ("hf", "assisted", 1, "greedy", "static", None)}
    for a, b in (("draft+overlap", "draft"), ("draft+overlap", "hf assisted"), ("draft", "hf assisted")):
        if keys[a] in runs and keys[b] in runs:
            out[f"specray {a} / {'specray ' if b == 'draft' else ''}{b}"] = within_repeats(
                runs[keys[a]].samples, runs[keys[b]].samples)
    return out


def run_order(plan: list[tuple], rep: int) -> list[tuple]:
    """The plan for repeat ``rep``: batch sizes in order, the configurations of each
    rotated by one place per repeat. A fixed order gives each configuration the same
    place and neighbour every time, and that alone can move a comparison by several
    percent (docs/benchmarks.md)."""
    out: list[tuple] = []
    for b in dict.fromkeys(key[2] for key in plan):
        out += rotated([key for key in plan if key[2] == b], rep)
    return out


def rotated(items: list, rep: int) -> list:
    shift = rep % len(items)
    return items[shift:] + items[:shift]


def best_config(samples: dict[str, list[float]]) -> str:
    """The configuration with the highest geometric mean of its tokens/s over the repeats.
    Not each repeat's faster one: where two are about even, the larger of two noisy
    samples beats both their means, and a configuration held to it scores below 1 even
    against itself."""
    return max(samples, key=lambda name: sum(math.log(x) for x in samples[name] if x > 0) / len(samples[name]))


def within_repeats(samples: list[float], base: list[float]) -> dict | None:
    """``samples[i] / base[i]`` over repeats i (each pair ran minutes apart at most, under
    the same machine load): median, min and max, and the geometric mean with its 95 %
    confidence interval (Student's t on the log ratios; None for a single pair); None
    without a pair.

    The interval is what tells a goal met "within noise" from one missed: one repeat's
    ratio of two configurations scatters widely on a shared machine."""
    ratios = [x / y for x, y in zip(samples, base) if x > 0 and y > 0]
    if not ratios:
        return None
    logs = [math.log(r) for r in ratios]
    mean = statistics.fmean(logs)
    ci = None
    if len(logs) > 1:
        half = _t975(len(logs) - 1) * statistics.stdev(logs) / math.sqrt(len(logs))
        ci = [math.exp(mean - half), math.exp(mean + half)]
    return {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios),
            "geomean": math.exp(mean), "ci95": ci}


# Student's t, two-sided 95 %, by degrees of freedom (1-10); beyond, a Cornish-Fisher
# expansion around the normal's 1.96 (within 0.01 % from 10 on).
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228)


def _t975(df: int) -> float:
    if df <= len(_T975):
        return _T975[df - 1]
    z = 1.959964
    return (z + (z ** 3 + z) / (4 * df) + (5 * z ** 5 + 16 * z ** 3 + 3 * z) / (96 * df ** 2)
            + (3 * z ** 7 + 19 * z ** 5 + 17 * z ** 3 - 15 * z) / (384 * df ** 3))


def paired_ratios(runs: list[Run]) -> list[dict]:
    """Each specray draft policy's tokens/s over plain decoding's, over the other
    policies' and over the best of those, within each repeat (``within_repeats``). The
    spread says how far two configurations differ by noise alone.

    "best other" is ``best_config`` of the others, named in ``best``."""
    out = []
    for run in runs:
        if run.system != "specray" or run.proposer not in SPECULATING or run.mode != "greedy":
            continue
        others = {o.label: o.samples for o in runs
                  if o.system == "specray" and o.mode == "greedy" and o.batch_size == run.batch_size
                  and o.proposer in (run.proposer, "none") and o is not run}
        if not others:
            continue
        # Adaptive variants are compared one by one, not as what a policy must beat.
        best = best_config({name: v for name, v in others.items() if ":" not in name})
        others["best other"] = others[best]
        for name, base in others.items():
            if (ratio := within_repeats(run.samples, base)) is not None:
                out.append({"batch_size": run.batch_size, "proposer": run.proposer, "policy": run.policy, "k": run.k,
                            "against": name,
                            **({"best": best} if name == "best other" else {}), **ratio})
    return out


def _public(r: Run) -> dict:
    d = asdict(r)
    for key in ("accepted", "drafted", "emitted", "seq_steps", "steps", "phase_s"):
        d.pop(key)
    return d


def write_outputs(result: dict, out_dir: str) -> tuple[Path, Path | None]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    jpath = out / "bench.json"
    jpath.write_text(json.dumps(result, indent=2))
    return jpath, _plot(result, out / "bench.png")


def _plot(result: dict, path: Path) -> Path | None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    runs = [r for r in result["runs"] if r["mode"] == "greedy"]
    for r in runs:
        r["label"] = (f"{r['system']}/{r['proposer']}" + (f"/{r['policy']}" if r["proposer"] == "draft" else "")
                      + (f"/k{r['k']}" if r.get("k") is not None else ""))
    labels = sorted({r["label"] for r in runs})
    sizes = sorted({r["batch_size"] for r in runs})
    fig, ax = plt.subplots(figsize=(8, 4.5))
    width = 0.8 / len(labels)
    for i, label in enumerate(labels):
        xs, ys, err = [], [], [[], []]
        for j, b in enumerate(sizes):
            for r in runs:
                if r["label"] == label and r["batch_size"] == b:
                    xs.append(j + i * width)
                    ys.append(r["tokens_per_s"])
                    err[0].append(r["tokens_per_s"] - r["tokens_per_s_min"])
                    err[1].append(r["tokens_per_s_max"] - r["tokens_per_s"])
        ax.bar(xs, ys, width, yerr=err, label=label, capsize=2)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(sizes))], [f"batch {b}" for b in sizes])
    ax.set_ylabel("tokens/s (median, min-max)")
    figures = (f"alpha={result['alpha']:.2f}, c={result['c']:.2f}" if result["alpha"] is not None
               else f"{result.get('prompt_set', 'code')} prompts")
    ax.set_title(f"specray bench: {result['draft_label']} draft, k={result['k']}, {figures}, {result['device']}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _policy(r: dict) -> str:
    return r["policy"] + (f" k{r['k']}" if r.get("k") is not None else "")


def format_table(result: dict) -> str:
    w = max([8] + [len(_policy(r)) for r in result["runs"]])        # the policy column, variants included
    against = lambda p: p["against"] + (f" ({p['best']})" if p.get("best") else "")  # noqa: E731
    a = max([14] + [len(against(p)) for p in result.get("paired", [])])
    head = f"{'system':8} {'proposer':9} {'policy':{w}} {'mode':8} {'batch':>5} {'tokens/s':>10} {'spread':>17} {'accept':>7} {'mean_len':>8}"
    lines = [head, "-" * len(head)]
    for r in result["runs"]:
        acc = f"{r['acceptance_rate']:.3f}" if r["acceptance_rate"] is not None else "-"
        mal = f"{r['mean_accepted_length']:.2f}" if r["mean_accepted_length"] is not None else "-"
        spread = f"{r['tokens_per_s_min']:.0f}-{r['tokens_per_s_max']:.0f}"
        lines.append(f"{r['system']:8} {r['proposer']:9} {_policy(r):{w}} {r['mode']:8} {r['batch_size']:>5} "
                     f"{r['tokens_per_s']:>10.1f} {spread:>17} {acc:>7} {mal:>8}")
    lines.append("")
    lines.append("per step, ms (draft and verify: the workers' own compute; overhead: the rest of the step)")
    names = [*PHASES, "overhead", "step"]
    head = f"{'proposer':9} {'policy':{w}} {'batch':>5} " + " ".join(f"{n:>9}" for n in names)
    lines += [head, "-" * len(head)]
    for r in result["runs"]:
        if r["step_ms"] and r["mode"] == "greedy":
            lines.append(f"{r['proposer']:9} {_policy(r):{w}} {r['batch_size']:>5} "
                         + " ".join(f"{r['step_ms'][n]:>9.3f}" for n in names))
    if result.get("paired"):
        lines.append("")
        lines.append("draft runs over others, tokens/s ratio within each repeat (median, min-max, "
                     "geometric mean and its 95 % interval)")
        head = (f"{'proposer':9} {'policy':{w}} {'batch':>5} {'against':>{a}} {'ratio':>6} {'spread':>11} "
                f"{'geomean':>8} {'95 %':>11}")
        lines += [head, "-" * len(head)]
        for p in result["paired"]:
            ci = f"{p['ci95'][0]:.2f}-{p['ci95'][1]:.2f}" if p["ci95"] else "-"
            lines.append(f"{p.get('proposer', 'draft'):9} {_policy(p):{w}} {p['batch_size']:>5} {against(p):>{a}} "
                         f"{p['median']:>6.3f} "
                         f"{p['min']:>5.2f}-{p['max']:.2f} {p['geomean']:>8.3f} {ci:>11}")
    if result.get("batch1_ratios"):
        lines.append("")
        lines.append("batch 1 tokens/s ratios within each repeat (median, min-max)")
        for name, q in result["batch1_ratios"].items():
            if q is not None:
                lines.append(f"  {name:28} {q['median']:6.3f}  {q['min']:.2f}-{q['max']:.2f}")
    lines.append("")
    if result["alpha"] is None:
        lines.append(f"k={result['k']}  no draft: n-gram and plain decoding only")
    else:
        lines.append(f"k={result['k']}  alpha={result['alpha']:.3f}  c={result['c']:.3f}  "
                     f"analytic bound={result['analytic_bound']:.2f}x  measured (draft vs none, batch 1)="
                     f"{result['measured_speedup']:.2f}x  efficiency={result['efficiency']:.2f}")
    lines.append(f"greedy outputs equal across every configuration: {result['greedy_outputs_equal']}")
    lines.append(f"prompts: the {result.get('prompt_set', 'code')} set, "
                 + ("the next ones every repeat (--rotate-prompts)" if result.get("rotate_prompts")
                                else "the same ones every repeat"))
    return "\n".join(lines)
