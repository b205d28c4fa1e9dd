"""Acceptance estimates and their depth calibration against what was accepted."""

from __future__ import annotations

import pytest

import random

from specray.scheduler.adaptive.acceptance import AcceptanceEstimate, DepthCalibration, RateSpread


def test_acceptance_estimate_counts_a_truncated_run_as_one_rejection():
    e = AcceptanceEstimate()
    e.observe(proposed=4, accepted=4, decay=1.0)
    e.observe(proposed=4, accepted=1, decay=1.0)
    assert (e.accepted, e.rejected) == (5, 1)
    assert e.rate(prior=0.5, prior_weight=0.0) == pytest.approx(5 / 6)
    e.observe(proposed=0, accepted=0, decay=1.0)             # a step without a proposal changes nothing
    assert (e.accepted, e.rejected) == (5, 1)


def test_depth_calibration_learns_that_deep_proposals_beat_the_independent_guess():
    # A draft whose acceptance climbs with depth (easy stretches stay easy): position 1 is
    # accepted half the time, and every later one always once its predecessor was.
    cal = DepthCalibration(decay=1.0, prior_weight=0.0)
    for i in range(200):
        cal.observe(rate=0.5, proposed=3, accepted=3 if i % 2 else 0)
    assert cal.lift(1) == pytest.approx(1.0)
    assert cal.lift(2) == pytest.approx(2.0)      # reached 100 times, predicted 0.5 each, all accepted
    assert cal.lift(3) == pytest.approx(2.0)
    # Calibrated gains are the realised ones; past the calibrated depth, the last lift.
    assert cal.gains([0.5], [3]) == [pytest.approx([0.5, 0.5, 0.5])]
    assert cal.lift(6) == cal.lift(3)


def test_depth_gains_stay_probabilities_and_never_rise_with_depth():
    cal = DepthCalibration(decay=1.0, prior_weight=0.0)
    cal.predicted[False], cal.realised[False] = [1.0, 1.0, 1.0], [1.0, 5.0, 0.5]    # lifts 1, 4 (capped), 0.5
    (row,) = cal.gains([0.9], [3])
    assert row == pytest.approx([0.9, 0.9, 0.9 * 0.9 * 0.5])       # conditional rates 0.9, 1, 0.45
    assert all(a >= b for a, b in zip(row, row[1:])) and max(row) <= 1.0
    # Nothing observed: the independent model as it is.
    assert DepthCalibration().gains([0.5, 0.2], [2, 1]) == [[0.5, 0.25], [pytest.approx(0.2)]]


def test_a_sequences_own_depth_counts_correct_its_rate():
    # The first proposal fails half the time, but once it passes the rest always do: the
    # per-token rate (0.8) overrates the first proposal and underrates the fourth.
    e = AcceptanceEstimate()
    for i in range(40):
        e.observe(proposed=4, accepted=4 if i % 2 else 0, decay=0.9)
    rate = e.rate(prior=0.5, prior_weight=0.0)
    assert rate == pytest.approx(0.8, abs=0.02)
    (plain,) = DepthCalibration().gains([rate], [4])
    (own,) = DepthCalibration().gains([rate], [4], [e])
    assert plain == pytest.approx([rate ** j for j in range(1, 5)])
    # Ten-odd observations against two pseudo-observations of the rate: most of the way.
    assert own[0] < 0.6 < rate
    assert own[3] > plain[3] + 0.05 and own[3] == pytest.approx(own[0], abs=0.06)


def test_calibration_keeps_steps_after_a_whole_acceptance_apart():
    # After a fully accepted proposal the next first guess passes 9 times in 10, after a
    # rejection half the time; the rate says 0.7 either way.
    cal = DepthCalibration(decay=1.0, prior_weight=0.0)
    for i in range(100):
        cal.observe(rate=0.7, proposed=1, accepted=1 if i % 10 else 0, after_full=True)
        cal.observe(rate=0.7, proposed=1, accepted=i % 2, after_full=False)
    assert cal.lift(1, after_full=True) == pytest.approx(0.9 / 0.7)
    assert cal.lift(1, after_full=False) == pytest.approx(0.5 / 0.7)
    hot, cold = AcceptanceEstimate(last_full=True), AcceptanceEstimate(last_full=False)
    assert cal.gains([0.7, 0.7], [1, 1], [hot, cold]) == [[pytest.approx(0.9)], [pytest.approx(0.5)]]
    e = AcceptanceEstimate()
    e.observe(proposed=3, accepted=3, decay=0.9)
    assert e.last_full
    e.observe(proposed=3, accepted=1, decay=0.9)
    assert not e.last_full


def _population(rates: list[float], steps: int, seed: int = 0) -> list[AcceptanceEstimate]:
    """Sequences proposing 4 tokens a step, each token accepted with the sequence's rate."""
    rng = random.Random(seed)
    out = []
    for r in rates:
        e = AcceptanceEstimate()
        for _ in range(steps):
            e.observe(4, next((j for j in range(4) if rng.random() > r), 4), decay=1.0)
        out.append(e)
    return out


def test_rate_spread_leans_on_the_overall_rate_when_sequences_are_alike():
    alike = RateSpread()
    for seed in range(20):
        alike.observe(_population([0.75] * 32, steps=10, seed=seed))
    # Sequences with one rate: what separates their records is luck.
    assert alike.weight > 30
    apart = RateSpread()
    for seed in range(20):
        apart.observe(_population([0.2, 0.95] * 16, steps=10, seed=seed))
    # Two kinds of sequence: each one's own record is most of the truth.
    assert apart.weight < 3


def test_rate_spread_matches_the_spread_it_was_drawn_from():
    # Rates drawn from a beta distribution with mean 0.7 and weight a + b = 9: the
    # method of moments should find rho = 1 / (a + b + 1) = 0.1, i.e. weight about 9.
    rng = random.Random(1)
    spread = RateSpread(decay=1.0)
    for seed in range(40):
        spread.observe(_population([rng.betavariate(6.3, 2.7) for _ in range(32)], steps=8, seed=seed))
    assert 6 < spread.weight < 13


def test_rate_spread_before_any_cross_section():
    spread = RateSpread()
    spread.observe(_population([0.5], steps=5))          # batch 1: nothing to compare
    spread.observe([AcceptanceEstimate(), AcceptanceEstimate()])    # nothing proposed yet
    assert spread.weight == pytest.approx(spread.prior_weight)


def test_rates_are_the_beta_posterior_mean_at_the_measured_weight():
    alike = RateSpread()
    for seed in range(20):
        alike.observe(_population([0.6] * 32, steps=10, seed=seed))
    w = alike.weight
    assert w > 20
    records = [AcceptanceEstimate(accepted=a, rejected=r) for a, r in [(12, 0), (8, 5), (0, 3), (0, 0)]]
    # The posterior mean: the record plus w pseudo-proposals at the overall rate.
    assert alike.rates(records, overall=0.6) == pytest.approx([(a + 0.6 * w) / (a + r + w)
                                                               for a, r in [(12, 0), (8, 5), (0, 3), (0, 0)]])
    # A draft that keeps failing one text comes down further with every rejection.
    falling = [alike.rates([AcceptanceEstimate(accepted=0, rejected=r)], overall=0.6)[0] for r in range(1, 14)]
    assert falling == sorted(falling, reverse=True)
