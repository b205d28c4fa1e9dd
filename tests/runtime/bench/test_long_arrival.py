"""``serve_load.py --prompts long``: streams decode while a long prompt arrives; each run
prefills that prompt afresh (a salt of its own), and reports per-token and per-delta waits."""

from __future__ import annotations

import pytest

from specray import RuntimeConfig, SpecRuntime, builtin_model
from specray.runtime.bench.long_arrival import long_prompt, run_long_arrival
from specray.workers.model_loader import load_tokenizer


def test_each_run_prefills_the_long_prompt_again_and_reports_its_waits(ray_session):
    target = builtin_model("tiny-target")
    tok = load_tokenizer(target)
    assert len(long_prompt(tok, 300)) == 300
    rt = SpecRuntime(RuntimeConfig(target=target, draft=builtin_model("tiny-draft"), layout="colocated",
                                   device="cpu", max_num_batched_tokens=64))
    try:
        first = run_long_arrival(rt, tok, 2, 12, 300, 0.0)
        before = rt.metrics()
        second = run_long_arrival(rt, tok, 2, 12, 300, 0.0)
        after = rt.metrics()
    finally:
        rt.shutdown()
    # The same long prompt again, and nothing of it found cached: a repeat measures a prefill.
    assert after["prefix_cache_queries"] > before["prefix_cache_queries"]
    assert after["prefix_cache_hits"] == before["prefix_cache_hits"]
    for r in (first, second):
        assert 0 < r["itl_p50_ms"] <= r["itl_p99_ms"]
        assert 0 < r["stall_p50_ms"] <= r["stall_p99_ms"] <= r["stall_max_ms"]
        assert r["itl_p99_over_p50"] == pytest.approx(r["itl_p99_ms"] / r["itl_p50_ms"])
        assert r["stall_p99_over_p50"] == pytest.approx(r["stall_p99_ms"] / r["stall_p50_ms"])
        assert r["long_ttft_ms"] > 0
