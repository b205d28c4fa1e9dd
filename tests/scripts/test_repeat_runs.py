"""Tests for benchmarks/repeat_runs.py: one bench run's ratios, and their aggregate over runs."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

import repeat_runs as rr  # noqa: E402


def run(system, proposer, b, policy, samples, mode="greedy"):
    return {"system": system, "proposer": proposer, "batch_size": b, "mode": mode, "policy": policy, "k": None,
            "samples": samples}


def result(static32, none32, adaptive32):
    return {"runs": [
        run("specray", "none", 1, "static", [300.0, 330.0]), run("hf", "none", 1, "static", [200.0, 300.0]),
        run("specray", "draft", 1, "static", [500.0, 400.0]), run("specray", "draft", 1, "adaptive", [450.0, 400.0]),
        run("hf", "assisted", 1, "static", [250.0, 200.0]),
        run("hf", "assisted", 1, "static", [1.0, 1.0], mode="sampled"),
        run("specray", "draft", 1, "adaptive:variant", [1.0, 1.0]),
        run("specray", "none", 32, "static", none32), run("hf", "none", 32, "static", [1000.0, 1000.0]),
        run("specray", "draft", 32, "static", static32), run("specray", "draft", 32, "adaptive", adaptive32),
    ]}


def test_one_runs_ratios_are_geometric_means_of_its_paired_repeats():
    got = rr.run_ratios(result([1000.0, 1300.0], [1200.0, 1200.0], [1100.0, 1150.0]))
    assert got["b1 specray none / hf generate"] == pytest.approx(math.sqrt(1.5 * 1.1))
    assert got["b1 specray draft (static) / hf assisted"] == pytest.approx(2.0)
    # Static's geometric mean sqrt(1000 * 1300) = 1140 < 1200: plain is the better mode.
    assert got["b32 static / better mode"] == pytest.approx(math.sqrt(1000 / 1200 * 1300 / 1200))
    assert got["b32 none / better mode"] == pytest.approx(1.0)
    assert got["b32 adaptive / better mode"] == pytest.approx(math.sqrt(1100 / 1200 * 1150 / 1200))
    assert got["b32 adaptive / static"] == pytest.approx(math.sqrt(1.1 * 1150 / 1300))
    # A variant is not one of the modes: it shows only as the mechanism's gain, adaptive over it.
    assert [name for name in got if "variant" in name] == ["b1 draft adaptive / adaptive:variant"]
    assert got["b1 draft adaptive / adaptive:variant"] == pytest.approx(math.sqrt(450 * 400))


def test_the_aggregate_is_the_geometric_mean_over_runs_with_a_t_interval():
    results = [result([1000.0, 1000.0], [1000.0, 1000.0], [a, a]) for a in (900.0, 1000.0, 1100.0)]
    rows = {name: (s, values) for name, s, values in rr.aggregate(results)}
    s, values = rows["b32 adaptive / better mode"]
    assert values == pytest.approx([0.9, 1.0, 1.1])
    logs = [math.log(v) for v in values]
    mean = sum(logs) / 3
    sd = math.sqrt(sum((x - mean) ** 2 for x in logs) / 2)
    assert s["geomean"] == pytest.approx(math.exp(mean))
    assert s["ci95"] == pytest.approx([math.exp(mean - 4.303 * sd / math.sqrt(3)),
                                       math.exp(mean + 4.303 * sd / math.sqrt(3))])


def test_from_reads_bench_outputs_and_refuses_other_files(tmp_path, capsys):
    for i, a in enumerate((900.0, 1100.0)):
        (tmp_path / f"run{i}").mkdir()
        (tmp_path / f"run{i}" / "bench.json").write_text(json.dumps(result([1000.0] * 2, [1000.0] * 2, [a, a])))
    assert rr.main(["--from", str(tmp_path / "run0"), str(tmp_path / "run1" / "bench.json")]) == 0
    assert "b32 adaptive / better mode" in capsys.readouterr().out
    (tmp_path / "run0.log").write_text("not json")
    with pytest.raises(SystemExit, match="run0.log"):
        rr.main(["--from", str(tmp_path / "run0.log")])
