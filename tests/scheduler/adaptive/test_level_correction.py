"""Measured corrections of the cost model's figure per speculation level."""

from __future__ import annotations

import pytest

from specray.scheduler.adaptive.acceptance import AcceptanceEstimate
from specray.scheduler.adaptive.level_correction import LevelCorrection
from specray.scheduler.adaptive.config import AdaptiveConfig
from specray.scheduler.adaptive.policy import AdaptivePolicy
from specray.scheduler.adaptive.step_cost import StepCostModel


def test_levels_keep_the_models_figure_until_two_are_measured():
    c = LevelCorrection()
    c.observe(4, level=3, seconds=0.01, predicted_seconds=0.02)
    c.observe(4, level=3, seconds=0.01, predicted_seconds=0.02)
    assert c.factors(4, [1, 2, 3]) == {1: 1.0, 2: 1.0, 3: 1.0}
    c.observe(4, level=2, seconds=0.01, predicted_seconds=0.01)
    assert c.factors(4, [2, 3]) == {2: 1.0, 3: 1.0}          # one sample is not enough
    # Level 0 (plain decoding) and unpriced steps are not a level's business.
    c.observe(4, level=0, seconds=0.01, predicted_seconds=0.02)
    c.observe(4, level=2, seconds=0.01, predicted_seconds=0.0)
    assert (4 .bit_length(), 0) not in c._sums and c._sums.steps((4 .bit_length(), 2)) == 1


def test_a_trial_level_is_ranked_by_its_steps_against_the_running_levels_of_the_moment():
    c = LevelCorrection(decay=1.0)
    for _ in range(3):       # level 4 runs, in 1/1.2 of the time the model prices it at
        c.observe(2, level=4, seconds=0.010, predicted_seconds=0.012)
    for _ in range(2):       # level 3, a trial now and then, slower than priced
        c.observe(2, level=3, seconds=0.010, predicted_seconds=0.009)
        c.observe(2, level=4, seconds=0.010, predicted_seconds=0.012)
    f = c.factors(2, [2, 3, 4])
    # Level 3 against level 4, 0.9 / 1.2 per trial, shrunk towards 1 by two pseudo-trials
    # (no decay here: each trial counts whole); the running level is the reference.
    assert f[4] == 1.0 and f[3] == pytest.approx((0.9 / 1.2) ** (2 / 4))
    assert f[2] == 1.0                                        # never tried
    # Another batch-size bucket knows nothing of it; extreme ratios are clamped.
    assert c.factors(32, [3, 4]) == {3: 1.0, 4: 1.0}
    for _ in range(4):
        c.observe(2, level=2, seconds=0.010, predicted_seconds=0.001)
        c.observe(2, level=4, seconds=0.010, predicted_seconds=0.012)
    assert c.factors(2, [2, 3, 4])[2] == c.limits[0]
    # Two steps in a row at another level: the policy moved there, and it is the
    # reference now (level 4 keeps its place relative to level 3 on the common scale).
    c.observe(2, level=3, seconds=0.010, predicted_seconds=0.009)
    c.observe(2, level=3, seconds=0.010, predicted_seconds=0.009)
    f = c.factors(2, [3, 4])
    assert f[3] == 1.0 and f[4] == 1.0                        # level 4 was never a trial


def test_a_slow_spell_during_a_levels_trials_does_not_count_against_it():
    # The machine slows for every level alike. Trials of level 2 fall in a slow spell,
    # and the running level's steps around them are as slow: the pairs see little
    # difference (the running level's ratio lags the spell by a step or two). Judged
    # against the running level's recent steps unpaired, level 2 came out 0.89.
    c = LevelCorrection()
    for spell in (1.0, 1.5, 1.0, 1.5, 1.0):
        for _ in range(5):
            c.observe(8, level=3, seconds=0.010 * spell, predicted_seconds=0.010)
        if spell > 1.0:
            c.observe(8, level=2, seconds=0.008 * spell, predicted_seconds=0.008)
    assert c.factors(8, [2, 3]) == pytest.approx({2: 1.0, 3: 1.0}, abs=0.05)


def test_two_fast_trial_steps_do_not_make_a_level_take_over():
    # A level tried twice in a fast spell of its own must not take over.
    c = LevelCorrection()
    for _ in range(20):      # level 4 runs everywhere and takes what the model says
        c.observe(1, level=4, seconds=0.011, predicted_seconds=0.011)
    for _ in range(2):       # level 1, tried twice: 1.3x
        c.observe(1, level=1, seconds=0.007, predicted_seconds=0.0091)
        c.observe(1, level=4, seconds=0.011, predicted_seconds=0.011)
    f = c.factors(1, [1, 4])
    assert 1.0 < f[1] / f[4] < 1.16            # taken at its word, 1.3
    # The same record, kept up, is believed more: five more such trials.
    for _ in range(5):
        c.observe(1, level=1, seconds=0.007, predicted_seconds=0.0091)
        c.observe(1, level=4, seconds=0.011, predicted_seconds=0.011)
    f = c.factors(1, [1, 4])
    assert f[1] / f[4] > 1.18


def _cost() -> StepCostModel:
    """Target: 1 ms + 10 us per token scored; draft: 0.1 ms + 0.5 ms per pass + 10 us per token."""
    c = StepCostModel()
    c.target.set_weights([1e-3, 0.0, 1e-5, 1e-5, 0.0, 0.0])
    c.draft.set_weights([1e-4, 5e-4, 1e-5, 1e-5])
    c.overhead.set_weights([0.0, 0.0])
    return c


def _run(policy: AdaptivePolicy, steps: int, cheap_level: int) -> list[int]:
    """Decode steps of 4 sequences that take the time the model prices them at, except at
    ``cheap_level``, whose steps take 0.6 of it (the model's split of the draft's cost
    overprices that level)."""
    batch = [AcceptanceEstimate(accepted=8, rejected=2) for _ in range(4)]
    levels = []
    for _ in range(steps):
        ks = policy.choose([4] * 4, batch, fed_tokens=4)
        n, seconds, level = policy._expected[:3]
        policy.observe_step(4, 4, sum(ks), 4 + sum(ks) // 2, seconds * (0.6 if max(ks) == cheap_level else 1.0))
        levels.append(max(ks))
    return levels


def test_the_policy_moves_to_a_level_that_runs_faster_than_the_model_prices_it():
    # The model rates level 2 best for these sequences (see the level-trial test in
    # the adaptive policy's tests); level 3 is tried every 4th step and, on this machine,
    # always takes 0.6 of its price.
    def policy(**kw) -> AdaptivePolicy:
        p = AdaptivePolicy(AdaptiveConfig(k=4, probe_interval=10**9, explore_levels_every=4), cost=_cost(),
                           overall=AcceptanceEstimate(accepted=80, rejected=20), **kw)
        p.switch.explore_every = 10**9
        return p

    blind = policy(levels=LevelCorrection(min_samples=10**9))
    assert _run(blind, 40, cheap_level=3)[-8:] == [2, 2, 2, 3, 2, 2, 2, 4]
    seeing = policy()
    late = _run(seeing, 40, cheap_level=3)[-8:]
    assert late.count(3) >= 6                      # level 3 now runs, the others as trials
