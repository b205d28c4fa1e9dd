"""``acceptance_by_position`` (``SpecStats``) against per-position counts made from the
tokens: random proposals checked against random target tokens, position by position."""

from __future__ import annotations

import random

import pytest

from specray.scheduler.proposal_choice import common_prefix
from specray.scheduler.stats import SpecStats
from specray.scheduler.step import ScheduledStep, StepOutcome, Verdict


def test_acceptance_by_position_is_accepted_at_j_over_proposed_at_j():
    k = 5
    rng = random.Random(3)
    stats = SpecStats(k)
    proposed, accepted = [0] * k, [0] * k
    for step_id in range(300):
        verdicts = []
        for sid in range(rng.randrange(1, 6)):
            n = rng.randrange(0, k + 1)
            props = [rng.randrange(3) for _ in range(n)]
            target = [rng.randrange(3) for _ in range(n + 1)]      # the target's tokens at each position
            for j in range(1, n + 1):                              # position j: proposed, and kept if the
                proposed[j - 1] += 1                               # first j all equal the target's
                accepted[j - 1] += props[:j] == target[:j]
            a = common_prefix(props, target)
            verdicts.append(Verdict(sid, n, a, tuple(target[:a + 1])))
        stats.record(StepOutcome(ScheduledStep(step_id, [], [], []), verdicts))
    rates = stats.as_dict()["acceptance_by_position"]
    assert len(rates) == k
    assert rates == pytest.approx([a / p for a, p in zip(accepted, proposed)])
    assert rates[0] == pytest.approx(1 / 3, abs=0.06) and rates[-1] < rates[0]


def test_positions_nobody_proposed_at_read_zero():
    stats = SpecStats(3)
    assert stats.as_dict()["acceptance_by_position"] == [0.0, 0.0, 0.0]
    stats.record(StepOutcome(ScheduledStep(1, [], [], []), [Verdict(1, 1, 1, (4, 5))]))
    assert stats.as_dict()["acceptance_by_position"] == [1.0, 0.0, 0.0]
    assert SpecStats(0).as_dict()["acceptance_by_position"] == []
