"""ConfidenceCalibration: per decile of the draft's probability, how often the target
accepted such a proposal, counted over exactly the proposals the target looked at."""

from __future__ import annotations

import random

import pytest

from specray.scheduler.adaptive.draft_confidence import ConfidenceCalibration, decile
from specray.scheduler.messages import REACH_BINS


def test_an_unmeasured_decile_reads_as_a_calibrated_draft():
    assert ConfidenceCalibration().reach_map() == pytest.approx([(b + 0.5) / REACH_BINS for b in range(REACH_BINS)])


def test_only_proposals_up_to_the_first_rejection_count():
    cal = ConfidenceCalibration(decay=1.0, prior_weight=0.0 + 1e-12)
    # Accepted, accepted, rejected; the fourth was never judged.
    cal.observe([0.95, 0.55, 0.25, 0.05], accepted=2)
    got = cal.reach_map()
    assert got[9] == pytest.approx(1.0) and got[5] == pytest.approx(1.0)
    assert got[2] == pytest.approx(0.0, abs=1e-9)
    assert got[0] == pytest.approx(0.05)          # untouched: its prior, whatever its weight
    # All accepted: each one counts as accepted, none as rejected.
    cal.observe([0.25, 0.25], accepted=2)
    assert cal.reach_map()[2] == pytest.approx(2 / 3)
    assert cal.observations == 2


def test_the_map_converges_to_each_deciles_acceptance_rate():
    """A draft that is underconfident in a known way (as the built-in one is): a proposal
    it gives probability c is accepted with probability sqrt(c)."""
    rng = random.Random(3)
    cal = ConfidenceCalibration(decay=1.0)
    looked = [0] * REACH_BINS
    hits = [0] * REACH_BINS
    for _ in range(4000):
        conf = [rng.random() for _ in range(4)]
        accepted = 0
        while accepted < 4 and rng.random() < conf[accepted] ** 0.5:
            accepted += 1
        for j, c in enumerate(conf[:accepted + 1]):
            looked[decile(c)] += 1
            hits[decile(c)] += j < accepted
        cal.observe(conf, accepted)
    w = cal.prior_weight
    expect = [(h + w * (b + 0.5) / REACH_BINS) / (n + w) for b, (h, n) in enumerate(zip(hits, looked))]
    assert cal.reach_map() == pytest.approx(expect)
    # And that is the truth, within sampling error: sqrt of the decile's typical value.
    for b in range(1, REACH_BINS):
        assert cal.reach_map()[b] == pytest.approx(((b + 0.5) / REACH_BINS) ** 0.5, abs=0.06)


def test_old_observations_fade():
    """A draft that got better: with a memory of about ten proposals the decile reads the
    new rate (shrunk by its prior: (10 + 2 * 0.85) / 12); remembering all, half of it."""
    fading, lasting = ConfidenceCalibration(decay=0.9), ConfidenceCalibration(decay=1.0)
    for accepted in [0] * 200 + [1] * 200:
        for cal in (fading, lasting):
            cal.observe([0.85], accepted=accepted)
    assert fading.reach_map()[8] == pytest.approx((10 + 2 * 0.85) / 12, abs=1e-3)
    assert lasting.reach_map()[8] == pytest.approx((200 + 2 * 0.85) / 402)


def test_deciles_match_the_workers_binning():
    assert [decile(x) for x in (0.0, 0.0999, 0.1, 0.5, 0.9999, 1.0)] == [0, 0, 1, 5, 9, 9]
    with pytest.raises(ValueError, match="decay"):
        ConfidenceCalibration(decay=0.0)
