"""Tests for benchmarks/policy_replay.py: its recorded acceptance against what specray's
own runs accept, and its replay loop."""

from __future__ import annotations

import dataclasses
import os
import random
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest

# The replay is the adaptive policy's bench: without the package there is nothing to replay.
pytest.importorskip("specray.scheduler.adaptive")

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

import policy_replay as pr  # noqa: E402
from specray.stdlib_corpus import held_out_prompts  # noqa: E402
from specray.scheduler.adaptive.draft_confidence import ConfidenceCalibration  # noqa: E402
from specray.scheduler.speculation_policy import StaticPolicy  # noqa: E402
from specray_testing import FixedFloorPolicy  # noqa: E402

TARGET, DRAFT = str(REPO / "models" / "tiny-target"), str(REPO / "models" / "tiny-draft")
TOKENS = 24


@pytest.fixture(scope="module")
def table() -> pr.AcceptanceTable:
    return pr.record(TARGET, DRAFT, held_out_prompts(3), TOKENS, k=4)


def _specray_counts(k: int, prompts: list[str]) -> tuple[list[int], list[int]]:
    """Per request, proposals made and accepted by a real static-k run."""
    outs = pr.static_greedy_run(TARGET, DRAFT, prompts, TOKENS, k)
    return [o.num_draft_tokens for o in outs], [o.num_accepted_tokens for o in outs]


@pytest.mark.parametrize("k", [4, 2])
def test_a_replayed_static_run_proposes_and_accepts_what_specray_did(table, k):
    # A table recorded at k = 4 holds at most 4 matches per position; min(k, L) replays
    # any smaller k too, as long as the run stays greedy.
    clipped = pr.AcceptanceTable(k, table.prompt_lens, [[min(k, x) for x in row] for row in table.matches])
    run = pr.replay_batch(StaticPolicy(k), clipped, 3, TOKENS, pr.StepSurface(), random.Random(0))
    assert (run.proposed, run.accepted) == _specray_counts(k, held_out_prompts(3))
    assert 0 < sum(run.accepted) < sum(run.proposed)          # the draft is neither always right nor useless


def test_policies_keep_within_their_own_k_on_a_wider_table(table):
    """The table's k is the widest step, as a runtime's: static k = 2 on it replays as on
    a table clipped to 2, and adaptive with k = 2 reaches past 2 alone, where its draft
    stops early (max_speculative_tokens; the adaptive policy's tests check that a batch
    does not)."""
    clipped = pr.AcceptanceTable(2, table.prompt_lens, [[min(2, x) for x in row] for row in table.matches],
                                 [[c[:2] for c in row] for row in table.confidence])
    wide = pr.replay_batch(StaticPolicy(2), table, 3, TOKENS, pr.StepSurface(), random.Random(0))
    narrow = pr.replay_batch(StaticPolicy(2), clipped, 3, TOKENS, pr.StepSurface(), random.Random(0))
    assert (wide.proposed, wide.accepted, wide.steps) == (narrow.proposed, narrow.accepted, narrow.steps)
    alone = [pr.replay_batch(pr.policy_factory({"k": 2, "max_speculative_tokens": 4})(), table, 1, TOKENS,
                             pr.StepSurface(), random.Random(0), first=i) for i in range(3)]
    assert any(run.proposed[0] > 2 * run.steps for run in alone)


def test_plain_decoding_replays_one_token_per_step_and_is_deterministic_per_seed(table):
    plain = pr.replay_batch(None, table, 3, TOKENS, pr.StepSurface(), random.Random(0))
    assert plain.steps == TOKENS and plain.proposed == [0, 0, 0]
    factories = {"adaptive": pr.policy_factory({"k": 4}), "none": lambda: None}
    a = pr.replay_bench(factories, table, [1, 3], TOKENS, repeats=2, seeds=2, surface=pr.StepSurface(), noise=0.05)
    b = pr.replay_bench(factories, table, [1, 3], TOKENS, repeats=2, seeds=2, surface=pr.StepSurface(), noise=0.05)
    assert a == b and all(len(v) == 4 and min(v) > 0 for v in a.values())
    # Speculating with this pair beats plain decoding at batch 1 on the surface's costs.
    assert min(x / y for x, y in zip(a[(1, "adaptive")], a[(1, "none")])) > 1.2
    with pytest.raises(ValueError, match="fewer than max_tokens"):
        pr.replay_batch(None, table, 1, TOKENS + 1, pr.StepSurface(), random.Random(0))


def test_variants_set_the_policys_fields_and_its_components():
    pol = pr.policy_factory({"k": 3, "explore_levels_every": 32, "spread.prior_weight": 5.0})()
    assert (pol.config.k, pol.config.explore_levels_every, pol.spread.prior_weight) == (3, 32, 5.0)
    with pytest.raises(TypeError, match="nonsense"):
        pr.policy_factory({"nonsense": 1})
    with pytest.raises(ValueError, match="spread has no field 'nonsense'"):
        pr.policy_factory({"spread.nonsense": 1})()


def test_a_table_survives_its_json(table):
    assert pr.AcceptanceTable.from_json(table.to_json()) == table


def test_rotated_rounds_serve_the_next_prompts():
    # Prompt 0's draft is always right, prompt 1's never: which one a batch of 1 serves
    # shows in its step count.
    table = pr.AcceptanceTable(4, [10, 10], [[4] * TOKENS, [0] * TOKENS])
    steps = [pr.replay_batch(StaticPolicy(4), table, 1, TOKENS, pr.StepSurface(), random.Random(0),
                             noise=0.0, first=first).steps for first in (0, 1, 2)]
    assert steps == [5, TOKENS, 5]                        # 4 + 1 per step until the cap; wraps around
    factories = {"static": lambda: StaticPolicy(4)}
    kw = dict(batch_sizes=[1], max_tokens=TOKENS, repeats=2, seeds=1, surface=pr.StepSurface(), noise=0.0)
    same = pr.replay_bench(factories, table, **kw)[(1, "static")]
    rotated = pr.replay_bench(factories, table, rotate=True, **kw)[(1, "static")]
    assert same[0] == same[1] == rotated[0] > 3 * rotated[1]


def test_a_surfaces_prefill_base_is_paid_once_by_the_first_step():
    table = pr.AcceptanceTable(4, [10], [[0] * TOKENS])
    base = pr.StepSurface()
    slow = dataclasses.replace(base, prefill=1.0)
    t = [TOKENS / pr.replay_batch(None, table, 1, TOKENS, s, random.Random(0), noise=0.0).tokens_per_s
         for s in (base, slow)]
    assert t[1] - t[0] == pytest.approx(1.0)


def test_drift_slows_every_kind_of_step_alike_in_spells_shared_by_a_rounds_policies():
    d = pr.Drift(0.3, period=5, seed=7)
    speeds = [d.factor() for _ in range(20)]
    again = pr.Drift(0.3, period=5, seed=7)
    assert speeds == [again.factor() for _ in range(20)]
    assert all(len(set(speeds[i:i + 5])) == 1 for i in range(0, 20, 5)) and len(set(speeds)) == 4
    assert pr.Drift(0.0, period=5, seed=7).factor() == 1.0
    # A plain run's time scales with the spell it meets; both policies of a round meet it.
    surface, still = pr.StepSurface(), pr.replay_batch(None, table_of(2), 1, TOKENS, pr.StepSurface(), random.Random(0),
                                                     noise=0.0)
    slowed = pr.replay_batch(None, table_of(2), 1, TOKENS, surface, random.Random(0), noise=0.0,
                             drift=pr.Drift(0.3, period=10 * TOKENS, seed=7))
    assert still.tokens_per_s / slowed.tokens_per_s == pytest.approx(pr.Drift(0.3, 10 * TOKENS, 7).factor())
    factories = {"adaptive": pr.policy_factory({"k": 4}), "none": lambda: None}
    drifting = pr.replay_bench(factories, table_of(2), [1], TOKENS, repeats=2, seeds=1, surface=surface, noise=0.0,
                               drift=0.3)
    assert drifting != pr.replay_bench(factories, table_of(2), [1], TOKENS, repeats=2, seeds=1, surface=surface,
                                       noise=0.0)


def table_of(match: int) -> pr.AcceptanceTable:
    return pr.AcceptanceTable(4, [10, 12], [[match] * TOKENS, [match] * TOKENS])


def test_the_cli_replays_on_either_surface(capsys, monkeypatch, tmp_path):
    table = pr.AcceptanceTable(4, [10, 12], [[2] * TOKENS, [4] * TOKENS])
    path = tmp_path / "table.json"
    path.write_text(table.to_json())
    lines = {}
    for surface in pr.SURFACES:
        monkeypatch.setattr(sys, "argv", ["policy_replay.py", "--table", str(path), "--tokens", str(TOKENS),
                                          "--batch-sizes", "1,2", "--repeats", "2", "--seeds", "1",
                                          "--surface", surface])
        pr.main()
        lines[surface] = capsys.readouterr().out.splitlines()
    plain = {surface: [float(row.split()[2]) for row in out[1:]] for surface, out in lines.items()}
    # Plain decoding's tokens/s follow the surface: a launch-bound step of a tiny model
    # is several times shorter than this CPU's.
    assert all(g > 2 * c for g, c in zip(plain["launch-bound"], plain["cpu"]))


def test_the_table_holds_the_drafts_probability_of_each_token_it_proposed(table):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(DRAFT, dtype=torch.float32).eval()
    outs = pr.static_greedy_run(TARGET, DRAFT, held_out_prompts(1), TOKENS, 4)
    ctx0 = list(outs[0].prompt_token_ids)
    for p in (0, 5, TOKENS - 1):
        ctx = ctx0 + list(outs[0].token_ids[:p])
        with torch.no_grad():
            for j in range(4):
                probs = torch.softmax(model(torch.tensor([ctx])).logits[0, -1].float(), -1)
                # Greedy: the proposal is the draft's most likely token.
                assert table.confidence[0][p][j] == pytest.approx(probs.max().item(), abs=1e-5)
                ctx.append(int(probs.argmax()))


def floor_policy(floor: float, raw: bool) -> FixedFloorPolicy:
    return FixedFloorPolicy(4, floor, calibration=None if raw else ConfidenceCalibration())


@pytest.mark.parametrize("raw", [True, False])
def test_replayed_early_stops_propose_and_accept_what_specray_did(table, raw):
    from specray.config import RuntimeConfig
    from specray.driver import DriverCore
    from specray.scheduler.sampling_params import SamplingParams

    floor = 0.35
    drv = DriverCore(RuntimeConfig(target=TARGET, draft=DRAFT, num_speculative_tokens=4, device="cpu",
                                   dtype="float32", speculation_policy="adaptive", max_num_seqs=3), backend="local")
    try:
        drv.scheduler.policy = floor_policy(floor, raw)
        params = SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True)
        outs = drv.wait(drv.submit(held_out_prompts(3), [params] * 3).request_ids, timeout=600)
        stopped = drv.metrics()["num_stopped_proposals"]
    finally:
        drv.shutdown()
    run = pr.replay_batch(floor_policy(floor, raw), table, 3, TOKENS, pr.StepSurface(), random.Random(0))
    assert (run.proposed, run.accepted) == ([o.num_draft_tokens for o in outs], [o.num_accepted_tokens for o in outs])
    # The floor did stop drafts, in both.
    static = pr.replay_batch(StaticPolicy(4), table, 3, TOKENS, pr.StepSurface(), random.Random(0))
    assert stopped > 0 and sum(run.proposed) < sum(static.proposed)


def test_drafts_stop_where_the_product_of_calibrated_probabilities_falls_below_the_floor():
    conf = [[0.9, 0.5, 0.9, 0.9], [0.9, 0.5, 0.9, 0.9], [0.05, 0.9, 0.9, 0.9], [0.9, 0.9, 0.9, 0.9]]
    # Raw: 0.9 then 0.45 < 0.5 (stops at 2, keeping the second); k_i = 3 with no floor
    # proposes all 3; 0.05 stops at once; a cap of 1 never stops.
    assert pr.made_proposals([4, 3, 4, 1], [0.5, 0.0, 0.5, 0.5], [], conf) == [2, 3, 1, 1]
    # Calibrated by decile: 0.9 -> 1.0 and 0.5 -> 0.6 keep reach >= 0.55 to the end.
    reach_map = [0.1] * 5 + [0.6] * 4 + [1.0]
    assert pr.made_proposals([4], [0.55], reach_map, conf[:1]) == [4]
