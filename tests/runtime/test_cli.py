"""The README's run command and the benchmark, as a user runs them (subprocesses with
their own embedded Ray)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from runtime.bench import OutputCheck, analytic_speedup

ROOT = Path(__file__).resolve().parents[2]
SPECRAY = [sys.executable, "-m", "runtime.cli"]


def run_cli(args: list[str], timeout: int = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)
    env["RAY_TMPDIR"] = tempfile.mkdtemp(prefix="src", dir="/tmp")
    return subprocess.run(SPECRAY + args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def test_generate_demo_with_the_builtin_pair():
    p = run_cli(["generate", "def fibonacci(n):", "--max-tokens", "48"])
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.startswith("def fibonacci(n):")
    assert "acceptance_rate=" in p.stdout and "mean_accepted_length=" in p.stdout and "tokens/s" in p.stdout
    rate = float(p.stdout.split("acceptance_rate=")[1].split()[0])
    assert 0.0 < rate <= 1.0


def test_generate_rejects_bad_flags_with_the_field_name():
    p = run_cli(["generate", "x = 1", "--temperature", "-1"])
    assert p.returncode == 2
    assert "temperature" in p.stderr


def test_bench_quick_json_has_every_field(tmp_path):
    out = tmp_path / "bench"
    p = run_cli(["bench", "--quick", "--batch-sizes", "1,8,32", "--out", str(out)], timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    result = json.loads((out / "bench.json").read_text())
    for key in ("k", "alpha", "c", "analytic_bound", "efficiency", "greedy_outputs_equal", "runs"):
        assert key in result
    assert result["greedy_outputs_equal"] is True
    assert (out / "bench.png").stat().st_size > 1000
    seen = {(r["system"], r["proposer"], r["batch_size"]) for r in result["runs"]}
    for b in (1, 8, 32):
        for proposer in ("draft", "ngram", "none"):
            assert ("specray", proposer, b) in seen
        assert ("hf", "none", b) in seen
    assert ("hf", "assisted", 1) in seen
    for r in result["runs"]:
        for key in ("system", "proposer", "batch_size", "tokens_per_s", "acceptance_rate", "mean_accepted_length"):
            assert key in r
        assert r["tokens_per_s"] > 0
    draft1 = next(r for r in result["runs"] if r["proposer"] == "draft" and r["batch_size"] == 1
                  and r["mode"] == "greedy")
    assert result["alpha"] == pytest.approx(draft1["acceptance_rate"])
    assert result["analytic_bound"] == pytest.approx(analytic_speedup(result["alpha"], result["c"], result["k"]))


def test_analytic_speedup_limits():
    assert analytic_speedup(0.0, 0.1, 4) == pytest.approx(1 / 1.4)
    assert analytic_speedup(1.0, 0.0, 4) == pytest.approx(5.0)
    # Matches the expected-emitted-tokens sum 1 + a + ... + a^k over the cost c k + 1.
    a, c, k = 0.7, 0.05, 3
    assert analytic_speedup(a, c, k) == pytest.approx(sum(a**i for i in range(k + 1)) / (c * k + 1))


def test_output_check_flags_a_mismatch():
    check = OutputCheck()
    check.check("a", [0, 1], [[1, 2, 3], [4, 5]])
    check.check("b", [0, 1], [[1, 2, 3], [4, 6]])
    assert check.mismatches == ["b: prompt 1 differs from the reference at token 1"]
