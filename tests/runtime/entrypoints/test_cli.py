"""The README's run command and the benchmark, as a user runs them (subprocesses with
their own embedded Ray)."""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from specray.runtime.bench.run import OutputCheck, batch_prompts, gpu_shares, prompt_slices, run_order
from specray.runtime.bench.settings import PHASES, BenchSettings, Run
from specray.runtime.bench.stats import analytic_speedup, paired_ratios, t975, within_repeats

ROOT = Path(__file__).resolve().parents[2]
SPECRAY = [sys.executable, "-m", "specray.runtime.entrypoints.cli"]


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
    # Batch 1 is not asked for: it runs anyway, the analytic bound needs it.
    # Co-located and short: the fields are under test here, not the speed (the client and
    # fault tests drive worker actors).
    # Rotated: the second repeat serves other prompts, and every prompt's greedy output
    # still has to agree across the configurations that served it.
    p = run_cli(["bench", "--quick", "--colocate", "--max-tokens", "12", "--repeats", "2", "--batch-sizes", "4",
                 "--rotate-prompts", "--static-k", "2", "--out", str(out)], timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    result = json.loads((out / "bench.json").read_text())
    for key in ("k", "alpha", "c", "analytic_bound", "efficiency", "greedy_outputs_equal", "runs"):
        assert key in result
    assert result["greedy_outputs_equal"] is True and result["rotate_prompts"] is True
    assert (out / "bench.png").stat().st_size > 1000
    seen = {(r["system"], r["proposer"], r["batch_size"]) for r in result["runs"]}
    for b in (1, 4):
        for proposer in ("draft", "ngram", "none"):
            assert ("specray", proposer, b) in seen
        assert ("hf", "none", b) in seen
    assert ("hf", "assisted", 1) in seen
    for r in result["runs"]:
        for key in ("system", "proposer", "batch_size", "tokens_per_s", "acceptance_rate", "mean_accepted_length"):
            assert key in r
        assert r["tokens_per_s"] > 0
        assert r["overlap"] is False        # co-located: no overlap runs
        if r["system"] == "specray":
            assert r["layout"] == "colocated" and r["torch_threads"] == 1
    draft1 = next(r for r in result["runs"] if r["proposer"] == "draft" and r["batch_size"] == 1
                  and r["mode"] == "greedy")
    assert result["alpha"] == pytest.approx(draft1["acceptance_rate"])
    assert result["analytic_bound"] == pytest.approx(analytic_speedup(result["alpha"], result["c"], result["k"]))
    # Every specray run says where its step time went; the parts add up to the step.
    for r in result["runs"]:
        if r["system"] == "specray":
            ms = r["step_ms"]
            assert ms["draft" if r["proposer"] == "draft" else "verify"] > 0 and ms["messaging"] >= 0
            assert ms["step"] == pytest.approx(sum(ms[p] for p in PHASES))
            assert ms["overhead"] == pytest.approx(ms["step"] - ms["draft"] - ms["verify"])
        else:
            assert r["step_ms"] is None
    assert "per step, ms" in p.stdout
    # At batch 1 a fixed k = 2 ran too (--static-k), and is compared like the bench's k.
    assert result["static_ks"] == [2]
    assert [(r["batch_size"], r["k"]) for r in result["runs"] if r["k"] is not None] == [(1, 2)]
    assert {(q["batch_size"], q["k"], q["against"]) for q in result["paired"]} == {
        (4, None, "none"), (4, None, "best other"), (1, None, "none"), (1, None, "best other"),
        (1, None, "draft/static/k2"), (1, 2, "none"), (1, 2, "best other"), (1, 2, "draft/static")}
    assert "within each repeat" in p.stdout and "the next ones every repeat" in p.stdout


def test_bench_runtimes_are_sized_for_the_bench_not_the_models_window(monkeypatch):
    """Each worker's KV cache is sized for max_num_seqs sequences at max_model_len: at a
    real model's window, runtimes sharing one GPU would take half of what was left each."""
    import specray
    from specray.runtime.bench.run import start_runtimes

    configs = []

    class FakeRuntime:
        def __init__(self, config):
            configs.append(config)

    monkeypatch.setattr(specray, "SpecRuntime", FakeRuntime)
    s = BenchSettings(target="t", draft="d", batch_sizes=(1, 8), device="cpu")
    wanted = [("draft", "static", None), ("draft", "adaptive", None), ("none", "static", None), ("draft", "static", 6)]
    started = start_runtimes(s, wanted, 300)
    assert set(started) == set(wanted)
    assert [(c.model.max_model_len, c.cache.max_num_seqs) for c in configs] == [(300, 8)] * 4
    # The bench's k, or a swept one; none without a proposer.
    assert [c.speculation.num_speculative_tokens for c in configs] == [4, 4, 0, 6]


def test_each_repeat_draws_the_order_of_each_batch_sizes_configurations():
    import random
    from collections import Counter

    plan = [("specray", "draft", 1), ("specray", "none", 1), ("hf", "none", 1),
            ("specray", "draft", 8), ("specray", "none", 8), ("hf", "assisted", 1)]
    rng = random.Random(3)
    orders = [run_order(plan, rng) for _ in range(300)]
    for order in orders:
        assert sorted(order) == sorted(plan)
        assert [key[2] for key in order] == [1, 1, 1, 1, 8, 8]       # batch sizes in order
    # Every configuration of batch 1 takes each of its places about equally often.
    places = Counter((order.index(key), key) for order in orders for key in plan if key[2] == 1)
    assert min(places.values()) > 300 / 4 * 0.6
    # Seeded: the same seed gives the same orders.
    again = random.Random(3)
    assert [run_order(plan, again) for _ in range(300)] == orders


def test_rotated_repeats_serve_the_next_prompts():
    # The default: every repeat serves the same first prompts.
    assert [batch_prompts(64, 8, rep, rotate=False) for rep in range(3)] == [list(range(8))] * 3
    # Rotated: each repeat the next ones, batch 1 a new text every repeat; past the end it wraps.
    assert [batch_prompts(64, 1, rep, rotate=True) for rep in range(3)] == [[0], [1], [2]]
    assert batch_prompts(64, 8, 2, rotate=True) == list(range(16, 24))
    assert batch_prompts(10, 4, 2, rotate=True) == [8, 9, 0, 1]


def test_rotated_batch_sizes_serve_prompts_of_their_own_and_the_warm_up_another():
    starts, n = prompt_slices([1, 8, 32], repeats=3, rotate=True)
    assert starts == {1: 0, 8: 3, 32: 27} and n == 3 + 24 + 96 + 1
    served = {b: {starts[b] + i for rep in range(3) for i in batch_prompts(b * 3, b, rep, rotate=True)}
              for b in starts}
    assert sum(map(len, served.values())) == n - 1            # disjoint, and none is the warm-up's
    assert set().union(*served.values()) == set(range(n - 1))
    assert prompt_slices([1, 8], repeats=3, rotate=False) == ({1: 0, 8: 0}, 9)


def test_paired_ratios_compare_runs_within_each_repeat():
    def run(proposer, policy, samples, b=8):
        return Run("specray", proposer, b, policy=policy, samples=samples)
    # Repeat 2 ran in a slow spell: every configuration slowed down alike.
    adaptive = run("draft", "adaptive", [110.0, 100.0, 55.0])
    static = run("draft", "static", [100.0, 105.0, 50.0])
    none = run("none", "static", [120.0, 90.0, 50.0])
    hf = Run("hf", "none", 8, samples=[500.0, 500.0, 500.0])
    other_batch = run("none", "static", [1.0, 1.0, 1.0], b=1)
    got = {(p["policy"], p["against"]): p for p in paired_ratios([adaptive, static, none, hf, other_batch])}
    assert set(got) == {("adaptive", "draft/static"), ("adaptive", "none"), ("adaptive", "best other"),
                        ("static", "draft/adaptive"), ("static", "none"), ("static", "best other")}
    # The best other is the configuration ahead over the repeats (plain decoding: geometric
    # mean 81.4 against static's 80.7), not each repeat's faster one.
    best = got[("adaptive", "best other")]
    assert best["best"] == "none" and got[("static", "best other")]["best"] == "draft/adaptive"
    assert best["median"] == pytest.approx(1.1)
    assert (best["min"], best["max"]) == (pytest.approx(110 / 120), pytest.approx(100 / 90))
    assert got[("static", "none")]["median"] == pytest.approx(1.0)
    # The geometric mean and its 95 % interval: Student's t with 2 degrees of freedom on
    # the log ratios.
    logs = [math.log(110 / 120), math.log(100 / 90), math.log(55 / 50)]
    half = 4.303 * statistics.stdev(logs) / math.sqrt(3)
    assert best["geomean"] == pytest.approx(math.exp(statistics.fmean(logs)))
    assert best["ci95"] == pytest.approx([math.exp(statistics.fmean(logs) - half),
                                          math.exp(statistics.fmean(logs) + half)])
    assert within_repeats([2.0], [1.0])["ci95"] is None and within_repeats([1.0], [0.0]) is None


def test_the_t_quantile_matches_students_table():
    # Two-sided 95 % points of Student's t (any statistics table).
    table = {1: 12.706, 2: 4.303, 5: 2.571, 10: 2.228, 11: 2.201, 15: 2.131, 20: 2.086, 30: 2.042,
             60: 2.000, 120: 1.980}
    assert {df: round(t975(df), 3) for df in table} == pytest.approx(table, abs=0.002)


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


def specray_actors_and_groups(dashboard: str) -> tuple[list[str], list[str]]:
    """Classes of the head's live specray actors and the states of its placement groups
    that still hold resources."""
    from ray.util.state import list_actors, list_placement_groups

    live = [a.class_name for a in list_actors(address=dashboard, filters=[("state", "!=", "DEAD")], limit=1000)
            if a.class_name in ("Driver", "DraftActor", "TargetActor")]
    groups = [g.state for g in list_placement_groups(address=dashboard, limit=1000) if g.state != "REMOVED"]
    return live, groups


@pytest.mark.parametrize("command", ["batch", "generate"])
def test_ctrl_c_releases_every_actor_and_placement_group(ray_head, llama_pair, tmp_path, command):
    """Ctrl-C in the middle of work on a shared cluster: the CLI exits promptly and leaves
    nothing behind on it (the cluster outlives the command, so nothing else would)."""
    import signal
    import time

    _, dashboard, env = ray_head
    t, d = llama_pair
    # Resources make the workers go through a placement group, which must be removed too.
    flags = ["-k", "3", "--device", "cpu", "--dtype", "float32",
             "--draft-resources", '{"CPU": 0.01}', "--target-resources", '{"CPU": 0.01}']
    if command == "batch":
        inp = tmp_path / "in.jsonl"
        inp.write_text("".join(json.dumps({"prompt": [1 + i % 90, 2, 3]}) + "\n" for i in range(20000)))
        args = ["batch", "--target", t, "--draft", d, *flags, "--input", str(inp),
                "--output", str(tmp_path / "out.jsonl"), "--max-tokens", "64", "--no-progress"]
    else:   # the built-in pair (a text prompt needs its tokenizer)
        args = ["generate", "def main():", *flags, "--max-tokens", "2000"]
    # As from a terminal: Ctrl-C's default handling, whatever this test process inherited (a
    # shell starting a job in the background without job control has it ignore SIGINT, and
    # children inherit that; Python then leaves it ignored).
    foreground = [sys.executable, "-c", "import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
                                        "from specray.runtime.entrypoints.cli import main; sys.exit(main())"]
    proc = subprocess.Popen(foreground + args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        deadline = time.time() + 120
        while time.time() < deadline and proc.poll() is None:
            live, groups = specray_actors_and_groups(dashboard)
            # The actor layout: the target worker lives in the driver's actor.
            if sorted(live) == ["DraftActor", "Driver"] and groups == ["CREATED"]:
                break
            time.sleep(0.5)
        else:
            pytest.fail(f"the command never got going: {proc.communicate(timeout=30)[0][-3000:]}")
        time.sleep(2.0)                                    # mid-generation
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        proc.send_signal(signal.SIGINT)
        out = proc.communicate(timeout=90)[0]
        assert proc.returncode == 130, out[-3000:]
        assert "Traceback" not in out and "specray: interrupted" in out, out[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    deadline = time.time() + 30
    while time.time() < deadline and specray_actors_and_groups(dashboard) != ([], []):
        time.sleep(0.5)
    assert specray_actors_and_groups(dashboard) == ([], [])


def test_bench_layouts_run_side_by_side():
    """--layouts actors,colocated: every configuration in the first layout, the first draft
    policy also co-located, on one thread a process and on every core."""
    import os

    from specray.runtime.bench.run import layouts, run_layout, runtime_config
    from specray.runtime.entrypoints.cli import build_parser

    s = BenchSettings(target="t", draft="d", layouts=("actors", "colocated"))
    cores = os.cpu_count()
    assert layouts(s) == ["actors", "colocated"] + (["colocated-all-cores"] if cores > 1 else [])
    assert run_layout(s, "static") == ("actors", 1)
    assert run_layout(s, "static+overlap") == ("actors", 1)
    assert run_layout(s, "static@colocated-all-cores") == ("colocated-all-cores", cores)
    cfg = runtime_config(s, "draft", "static@colocated-all-cores", None)
    assert cfg.cluster.layout == "colocated" and cfg.model.torch_threads == (cores if cores > 1 else 0)
    assert runtime_config(s, "draft", "static+overlap", None).speculation.overlap
    assert runtime_config(s, "draft", "static", None).cluster.layout == "actors"
    assert layouts(BenchSettings(target="t", draft="d")) == ["actors"]
    assert layouts(BenchSettings(target="t", draft="d", colocate=True)) == ["colocated"]
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "--layouts"])


def test_bench_runtimes_share_one_gpu(monkeypatch):
    """Every runtime of the bench lives at once: on CUDA each GPU-holding actor asks for
    an equal part of one GPU, so a one-GPU machine can host them all; on CPU nothing."""
    import torch

    from specray.workers import model_loader

    configs = [("draft", "static", None), ("draft", "adaptive", None), ("ngram", "static", None),
               ("none", "static", None)]
    assert gpu_shares(BenchSettings(target="t", draft="d", device="cpu"), configs) == {}
    monkeypatch.setattr(model_loader, "resolve_device", lambda device: torch.device("cuda"))
    actors = gpu_shares(BenchSettings(target="t", draft="d", device="cuda"), configs)
    # 2 draft runtimes x (target + draft) + 2 target-only runtimes = 6 workers.
    assert actors == {"target_resources": {"GPU": 0.16}, "draft_resources": {"GPU": 0.16}}
    colocated = gpu_shares(BenchSettings(target="t", draft="d", device="cuda", colocate=True), configs)
    assert colocated["target_resources"] == {"GPU": 0.25}


def test_sampling_flags_default_to_sampling_params():
    """`specray generate`, `specray batch` and the API sample alike unless told otherwise."""
    from specray.runtime.entrypoints.cli import build_parser
    from specray.scheduler.sampling_params import SamplingParams

    parser, api = build_parser(), SamplingParams()
    for argv in (["generate", "x"], ["batch", "--input", "in.jsonl", "--output", "-"]):
        args = parser.parse_args(argv)
        assert (args.temperature, args.top_p, args.top_k) == (api.temperature, api.top_p, api.top_k), argv
