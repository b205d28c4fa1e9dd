"""Measured against predicted step times per key, discounted per observation of the key."""

from __future__ import annotations

import pytest

from specray.scheduler.adaptive.outcome_sums import OutcomeSums


def test_ratio_is_predicted_over_measured_time_once_enough_steps_are_in():
    sums = OutcomeSums(decay=0.5)
    sums.add("a", seconds=0.01, predicted_seconds=0.02)
    assert sums.ratio("a", min_samples=2) is None and sums.steps("a") == 1
    sums.add("a", seconds=0.02, predicted_seconds=0.01)
    # Discounted: 0.01*0.5+0.02 = 0.025 s taken against 0.02*0.5+0.01 = 0.02 s predicted.
    assert sums.ratio("a", min_samples=2) == pytest.approx(0.02 / 0.025)
    # Another key decays only with its own observations, and knows nothing yet.
    assert sums.ratio("b", min_samples=1) is None and sums.steps("b") == 0
    sums.add("b", seconds=0.01, predicted_seconds=0.0)
    assert sums.ratio("b", min_samples=1) is None            # nothing predicted: no ratio
    assert sums["a"][2] == 2 and sums == {"a": sums["a"], "b": sums["b"]}
