"""Measured against predicted outcomes per key, discounted per observation of the key."""

from __future__ import annotations

import pytest

from scheduler.outcome_sums import OutcomeSums


def test_ratio_is_measured_over_predicted_goodput_once_enough_steps_are_in():
    sums = OutcomeSums(decay=0.5)
    sums.add("a", tokens=10, seconds=0.01, predicted_tokens=5, predicted_seconds=0.01)
    assert sums.ratio("a", min_samples=2) is None and sums.steps("a") == 1
    sums.add("a", tokens=6, seconds=0.02, predicted_tokens=6, predicted_seconds=0.01)
    # Discounted: tokens 10*0.5+6=11 in 0.025 s against 8.5 predicted in 0.015 s.
    assert sums.ratio("a", min_samples=2) == pytest.approx((11 / 0.025) / (8.5 / 0.015))
    # Another key decays only with its own observations, and knows nothing yet.
    assert sums.ratio("b", min_samples=1) is None and sums.steps("b") == 0
    sums.add("b", tokens=0, seconds=0.01, predicted_tokens=5, predicted_seconds=0.01)
    assert sums.ratio("b", min_samples=1) is None            # nothing emitted yet: no ratio
    assert sums["a"][4] == 2 and sums == {"a": sums["a"], "b": sums["b"]}
