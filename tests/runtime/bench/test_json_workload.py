"""``specray bench --workload json``: the grammar off and on side by side, its fields, and
the paired ratios taken from the same repeats."""

from __future__ import annotations

import json

import jsonschema
import pytest

from specray import RuntimeConfig, builtin_model
from specray.runtime.bench.json_workload import ASKS, SCHEMA, format_json_table, prompts, run_json_bench
from specray.runtime.bench.prompts import bench_prompts
from specray.workers.model_loader import load_tokenizer


def test_the_schema_is_a_valid_json_schema_and_prompts_use_the_chat_template():
    jsonschema.Draft202012Validator.check_schema(SCHEMA)
    tok = load_tokenizer(builtin_model("tiny-target"))        # the built-in pair has a plain chat template
    (code,) = bench_prompts("code", 1, tok)
    (p,) = prompts(tok, 1)
    text = f"{ASKS[0]}\n\n{tok.decode(code)}"
    assert p == tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                        add_generation_prompt=True)


def test_grammar_off_and_on_each_repeat_with_paired_ratios(ray_session):
    cfg = RuntimeConfig(target=builtin_model("tiny-target"), draft=builtin_model("tiny-draft"), proposer="draft",
                        num_speculative_tokens=3, layout="colocated", device="cpu")
    result = run_json_bench(cfg, (1,), max_tokens=6, repeats=2, temperature=0.8, progress=False)
    runs = {(r["mode"], r["grammar"]): r for r in result["runs"]}
    assert set(runs) == {(m, g) for m in ("greedy", "sampled") for g in (False, True)}
    for (_, grammar), r in runs.items():
        assert len(r["samples"]) == 2 and r["answers"] == 2 and r["tokens_per_s"] > 0
        assert 0 <= r["acceptance_rate"] <= 1 and r["mean_accepted_length"] >= 1
        assert (r["mask_ms_per_step"] > 0) == grammar
        assert r["finished_stop"] <= r["answers"]
    for mode in ("greedy", "sampled"):
        on, off = runs[(mode, True)], runs[(mode, False)]
        ratio = result["tokens_per_s_ratio_on_off"][f"1/{mode}"]
        assert ratio == pytest.approx(on["tokens_per_s"] / off["tokens_per_s"])
        q = result["tokens_per_s_ratio_within_repeats"][f"1/{mode}"]
        ratios = [x / y for x, y in zip(on["samples"], off["samples"])]
        assert q["min"] == pytest.approx(min(ratios)) and q["max"] == pytest.approx(max(ratios))
        assert q["ci95"][0] <= q["geomean"] <= q["ci95"][1]
    table = format_json_table(result)
    assert "tokens/s on / off: 1/greedy" in table and "1/sampled within repeats: geomean" in table
    json.dumps(result)          # written as bench.json as it is
