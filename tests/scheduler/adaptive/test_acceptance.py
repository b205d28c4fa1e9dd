"""Acceptance estimates, and what each further proposal is worth."""

from __future__ import annotations

import pytest

from specray.scheduler.adaptive.acceptance import AcceptanceEstimate, gains


def test_acceptance_estimate_counts_a_truncated_run_as_one_rejection():
    e = AcceptanceEstimate()
    e.observe(proposed=4, accepted=4, decay=1.0)
    e.observe(proposed=4, accepted=1, decay=1.0)
    assert (e.accepted, e.rejected) == (5, 1)
    assert e.rate(prior=0.5, prior_weight=0.0) == pytest.approx(5 / 6)
    e.observe(proposed=0, accepted=0, decay=1.0)             # a step without a proposal changes nothing
    assert (e.accepted, e.rejected) == (5, 1)


def test_gains_are_products_of_the_rate_and_stop_at_each_limit():
    assert gains([0.5, 1.0, 0.9], [3, 2, 0]) == [[0.5, 0.25, 0.125], [1.0, 1.0], []]
