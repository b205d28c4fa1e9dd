"""LevelChoices against every choice of k_i enumerated on small batches."""

from __future__ import annotations

import itertools
import random

import pytest

from specray.scheduler.adaptive.level_choice import LevelChoices
from specray.scheduler.adaptive.step_cost import StepPrice


def _rate(gains, ks, price) -> float:
    return (len(gains) + sum(sum(row[:k]) for row, k in zip(gains, ks))) / price.time(sum(ks), max(ks, default=0))


def _best_by_enumeration(gains, price, m) -> float:
    choices = itertools.product(*[range(len(row) + 1) for row in gains])
    return max(_rate(gains, ks, price) for ks in choices if max(ks) == m)


def _random_case(rng):
    gains = []
    for _ in range(rng.randint(1, 4)):
        row, g = [], 1.0
        for _ in range(rng.randint(0, 3)):
            g *= rng.random()
            row.append(g)
        gains.append(row)
    plain = rng.uniform(1.0, 10.0)
    # a verified token from nearly free to as dear as a plain step
    price = StepPrice(plain, rng.uniform(0.0, 1.0) * plain, rng.uniform(0.0, 0.5) * plain,
                      rng.uniform(0.0, 1.0) * plain)
    return gains, price


def test_every_level_gets_its_best_choice_of_any_k():
    rng = random.Random(0)
    for _ in range(400):
        gains, price = _random_case(rng)
        lc = LevelChoices(gains, price)
        top = max((len(row) for row in gains), default=0)
        assert sorted(lc.rates) == list(range(top + 1))       # plain, and every level some cap reaches
        assert lc.rates[0] == pytest.approx(len(gains) / price.plain)
        for m in range(1, top + 1):
            ks = lc.ks(m)
            assert max(ks) == m and all(k <= len(row) for k, row in zip(ks, gains))
            assert _rate(gains, ks, price) == pytest.approx(lc.rates[m])
            assert lc.rates[m] == pytest.approx(_best_by_enumeration(gains, price, m))


def test_a_level_is_reached_by_the_chain_that_costs_least():
    # In order of gain the first depth-2 candidate is sequence 0's, behind sequence 1's
    # first: taking that prefix proposes 3 tokens where sequence 1's chain of 2 does
    # better. The best prefix that reaches depth 2 undervalues level 2.
    gains = [[0.037, 0.035], [0.091, 0.031]]
    price = StepPrice(5.0, 1.0, 1.0, 0.2)
    lc = LevelChoices(gains, price)
    assert lc.ks(2) == [0, 2]
    assert lc.rates[2] == pytest.approx(_rate(gains, [0, 2], price)) and lc.rates[2] > _rate(gains, [2, 1], price)


def test_plain_and_no_caps():
    lc = LevelChoices([[], []], StepPrice(2.0, 1.0, 1.0, 1.0))
    assert lc.rates == {0: 1.0} and lc.ks(0) == [0, 0]
