"""``specray bench --workload json``: the same requests with a JSON-schema grammar off and
on, side by side in one run, on one runtime. Reported per batch size and mode (greedy,
sampled): output tokens/s of each, their ratio (the goal: at least 0.9), the acceptance
of each (a masked draft's should be no lower), and the grammar's host mask time per step.

The prompts ask, in the model's chat template where it has one, for a JSON record; the
schema asks for a list of records long enough that answers run to ``max_tokens`` either
way, so both sides emit about as many tokens.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass, field

from specray.runtime.bench.stats import within_repeats

SCHEMA = {"type": "object", "properties": {"records": {"type": "array", "minItems": 8, "maxItems": 8, "items": {
    "type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                     "id": {"type": "integer", "minimum": 0, "maximum": 99999},
                                     "tags": {"type": "array", "items": {"type": "string", "maxLength": 8},
                                              "maxItems": 3}},
    "required": ["name", "id", "tags"], "additionalProperties": False}}},
    "required": ["records"], "additionalProperties": False}
ASKS = ["List the modules this code imports as JSON records.", "Describe each function below as a JSON record.",
        "Give the classes of this file as JSON.", "Summarise the arguments as JSON records."]


@dataclass
class JsonRun:
    batch_size: int
    mode: str                        # "greedy" | "sampled"
    grammar: bool
    tokens_per_s: float = 0.0
    samples: list[float] = field(default_factory=list)
    acceptance_rate: float = 0.0
    mean_accepted_length: float = 0.0
    mask_ms_per_step: float = 0.0
    finished_stop: int = 0           # answers the grammar completed (grammar on)
    answers: int = 0


def prompts(tokenizer, count: int) -> list:
    from specray.runtime.bench.prompts import bench_prompts

    code = bench_prompts("code", count, tokenizer)
    out = []
    for i, ids in enumerate(code):
        text = f"{ASKS[i % len(ASKS)]}\n\n{tokenizer.decode(ids)}"
        if getattr(tokenizer, "chat_template", None):
            out.append(tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                     add_generation_prompt=True))
        else:
            out.append(text + "\n")
    return out


def run_json_bench(config, batch_sizes, max_tokens: int, repeats: int, temperature: float,
                   progress: bool = True) -> dict:
    """Every (batch size, mode) with the grammar off then on, ``repeats`` times in
    alternating order, on one runtime built from ``config`` (a ``RuntimeConfig``)."""
    from specray import SamplingParams, SpecRuntime
    from specray.workers.model_loader import load_tokenizer

    tok = load_tokenizer(config.model.target)
    rt = SpecRuntime(config)
    runs: dict[tuple, JsonRun] = {}
    try:
        rt.generate(prompts(tok, 2), SamplingParams(max_tokens=8, structured_output={"json": SCHEMA}))  # warm-up
        for b in batch_sizes:
            ps = prompts(tok, b)
            for mode in ("greedy", "sampled"):
                t = 0.0 if mode == "greedy" else temperature
                for rep in range(repeats):
                    for grammar in ((False, True) if rep % 2 == 0 else (True, False)):
                        so = {"json": SCHEMA} if grammar else None
                        params = [SamplingParams(max_tokens=max_tokens, temperature=t, seed=1000 * rep + i,
                                                 structured_output=so) for i in range(b)]
                        r = runs.setdefault((b, mode, grammar), JsonRun(b, mode, grammar))
                        before = rt.metrics()
                        t0 = time.perf_counter()
                        outs = rt.generate(ps, params)
                        wall = time.perf_counter() - t0
                        after = rt.metrics()
                        r.samples.append(sum(len(o.token_ids) for o in outs) / wall)
                        _account(r, before, after, outs)
                        if progress:
                            print(f"  batch {b} {mode} grammar {'on ' if grammar else 'off'} rep {rep}: "
                                  f"{r.samples[-1]:.1f} tok/s", flush=True)
    finally:
        rt.shutdown()
    rows = []
    for r in runs.values():
        r.tokens_per_s = statistics.median(r.samples)
        rows.append(r)
    ratios = {f"{b}/{m}": runs[(b, m, True)].tokens_per_s / runs[(b, m, False)].tokens_per_s
              for (b, m, g) in runs if g and runs[(b, m, False)].tokens_per_s}
    # Each repeat ran on and off back to back: their ratio per repeat, with its interval.
    paired = {f"{b}/{m}": within_repeats(runs[(b, m, True)].samples, runs[(b, m, False)].samples)
              for (b, m, g) in runs if g}
    return {"schema": SCHEMA, "max_tokens": max_tokens, "repeats": repeats, "temperature": temperature,
            "runs": [asdict(r) for r in rows], "tokens_per_s_ratio_on_off": ratios,
            "tokens_per_s_ratio_within_repeats": paired}


def _account(r: JsonRun, before: dict, after: dict, outs) -> None:
    drafted = after["num_draft_tokens"] - before["num_draft_tokens"]
    accepted = after["num_accepted_tokens"] - before["num_accepted_tokens"]
    seq_steps = after["num_seq_steps"] - before["num_seq_steps"]
    emitted = after["num_emitted_tokens"] - before["num_emitted_tokens"]
    steps = after["num_steps"] - before["num_steps"]
    n = len(r.samples)        # running means over the repeats
    r.acceptance_rate += ((accepted / drafted if drafted else 0.0) - r.acceptance_rate) / n
    r.mean_accepted_length += ((emitted / seq_steps if seq_steps else 0.0) - r.mean_accepted_length) / n
    r.mask_ms_per_step += ((after["mask_s"] - before["mask_s"]) / max(steps, 1) * 1e3 - r.mask_ms_per_step) / n
    r.answers += len(outs)
    r.finished_stop += sum(o.finish_reason == "stop" for o in outs)


def format_json_table(result: dict) -> str:
    lines = [f"{'batch':>5} {'mode':8} {'grammar':7} {'tok/s':>9} {'accept':>7} {'mean len':>8} "
             f"{'mask ms/step':>12} {'stop':>9}"]
    for r in sorted(result["runs"], key=lambda r: (r["batch_size"], r["mode"], r["grammar"])):
        lines.append(f"{r['batch_size']:>5} {r['mode']:8} {'on' if r['grammar'] else 'off':7} "
                     f"{r['tokens_per_s']:9.1f} {r['acceptance_rate']:7.3f} {r['mean_accepted_length']:8.2f} "
                     f"{r['mask_ms_per_step']:12.3f} {r['finished_stop']:>4}/{r['answers']:<4}")
    ratios = result["tokens_per_s_ratio_on_off"]
    lines.append("tokens/s on / off: " + ", ".join(f"{k} {v:.2f}" for k, v in ratios.items()))
    for k, q in result.get("tokens_per_s_ratio_within_repeats", {}).items():
        if q and q["ci95"]:
            lines.append(f"  {k} within repeats: geomean {q['geomean']:.2f} (95 % {q['ci95'][0]:.2f}-"
                         f"{q['ci95'][1]:.2f})")
    return "\n".join(lines)


def write_json_result(result: dict, out_dir: str) -> str:
    import os

    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "bench_json.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    return path
