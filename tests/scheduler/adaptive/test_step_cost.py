"""The online step-cost model: a non-negative least-squares fit with a ridge towards its
prior, one fit per batch-size bucket, and the step time it predicts."""

from __future__ import annotations

import itertools
import random

import pytest

from specray.scheduler.adaptive.step_cost import (
    BucketedFit,
    LinearFit,
    StepCostModel,
    _nonnegative_solve,
    _solve_linear,
)


def test_linear_fit_recovers_a_cost_model():
    fit = LinearFit(3)
    for n in range(1, 30):
        for tokens in (n, 2 * n, 5 * n):
            fit.add([1.0, n, tokens], 0.002 + 0.0001 * n + 0.00003 * tokens)
    assert fit.weights == pytest.approx([0.002, 0.0001, 0.00003], rel=1e-6, abs=1e-9)


def test_linear_fit_keeps_weights_non_negative_by_refitting_without_them():
    fit = LinearFit(3)
    # y falls with the last feature: the best non-negative fit drops it and refits the rest.
    for n in range(1, 40):
        fit.add([1.0, n, n % 5], 0.001 + 0.0002 * n - 0.0001 * (n % 5))
    w = fit.solve()
    assert w[2] == 0.0 and min(w) >= 0.0
    free = LinearFit(2)
    for n in range(1, 40):
        free.add([1.0, n], 0.001 + 0.0002 * n - 0.0001 * (n % 5))
    assert w[:2] == pytest.approx(free.solve(), rel=1e-6)


def _objective(a, b, w) -> float:
    n = len(b)
    return sum(w[i] * (sum(a[i][j] * w[j] for j in range(n)) / 2 - b[i]) for i in range(n))


def _best_by_enumeration(a, b) -> float:
    """The least objective over every support's unconstrained solution that is feasible."""
    n, best = len(b), 0.0                    # w = 0 is feasible
    for r in range(1, n + 1):
        for support in itertools.combinations(range(n), r):
            s = _solve_linear([[a[i][j] for j in support] for i in support], [b[i] for i in support])
            if s is not None and min(s) >= 0.0:
                w = [0.0] * n
                for i, v in zip(support, s):
                    w[i] = v
                best = min(best, _objective(a, b, w))
    return best


def test_a_weight_pinned_early_comes_back_when_the_optimum_wants_it():
    # Unconstrained, weights 0 and 1 are negative. Pinning the most negative and solving
    # again pins the other as well and leaves [0, 0, 0.43]; the optimum keeps weight 0.
    a = [[9.0, -6.0, -6.0], [-6.0, 14.0, 1.0], [-6.0, 1.0, 7.0]]
    b = [-2.0, -5.0, 3.0]
    w = _nonnegative_solve(a, b)
    assert w == pytest.approx([4 / 27, 0.0, 5 / 9])
    assert _objective(a, b, w) < _objective(a, b, [0.0, 0.0, 3 / 7])


def test_the_non_negative_solve_reaches_the_optimum_of_random_systems():
    rng = random.Random(0)
    for _ in range(500):
        n = rng.randint(1, 5)
        m = [[rng.gauss(0.0, 1.0) for _ in range(n)] for _ in range(n + 2)]
        a = [[sum(r[i] * r[j] for r in m) + (0.01 if i == j else 0.0) for j in range(n)] for i in range(n)]
        b = [rng.gauss(0.0, 1.0) for _ in range(n)]
        w = _nonnegative_solve(a, b)
        assert min(w) >= 0.0
        assert _objective(a, b, w) == pytest.approx(_best_by_enumeration(a, b), rel=1e-9, abs=1e-12)


def test_ridge_leaves_directions_the_data_do_not_reach_at_the_prior():
    # Every sample has feature 2 == feature 1: only their sum is identified. The data fix
    # the sum; the prior splits it.
    prior = [1e-3, 1e-4, 3e-4]
    fit = LinearFit(3, prior=prior, ridge=1.0)
    for n in range(1, 60):
        fit.add([1.0, n, n], 2e-3 + 6e-4 * n)
    w = fit.weights
    assert w[1] + w[2] == pytest.approx(6e-4, rel=0.05)
    assert w[2] > w[1] > 0                  # the prior's split survives, the sum moved
    assert fit.predict([1.0, 10, 10]) == pytest.approx(2e-3 + 6e-3, rel=0.05)


def test_relative_fit_is_not_dragged_by_a_few_slow_samples():
    # Ordinary steps cost 10 ms + 1 ms per unit; three "prefill" steps are 50x slower than
    # the model says. Relative errors keep the ordinary steps right.
    plain, relative = LinearFit(2), LinearFit(2, relative=True)
    for fit in (plain, relative):
        for i in range(60):
            x = 1 + i % 4
            fit.add([1.0, x], 0.010 + 0.001 * x)
        for _ in range(3):
            fit.add([1.0, 2.0], 0.6)
        fit.solve()
    ordinary = 0.012
    assert abs(relative.predict([1.0, 2.0]) - ordinary) / ordinary < 0.1
    assert abs(plain.predict([1.0, 2.0]) - ordinary) / ordinary > 1.0


def test_buckets_fit_their_own_batch_sizes_and_new_ones_start_from_a_neighbour():
    fit = BucketedFit(2, prior=[1e-3, 1e-4])
    for _ in range(10):
        for n in (1, 32, 48):
            # Per sequence: 1 ms at batch 1, 0.2 ms at 32-63 (rows get cheaper in bulk).
            fit.add(n, [1.0, float(n)], 0.005 + (0.001 if n == 1 else 0.0002) * n)
    assert fit.predict(1, [1.0, 1.0]) == pytest.approx(0.006, rel=1e-3)
    assert fit.predict(32, [1.0, 32.0]) == pytest.approx(0.0114, rel=1e-3)
    # Batch 40 is in bucket 6 (32-63); batch 100's bucket has no samples yet, so the
    # nearest fitted bucket answers.
    assert fit.predict(40, [1.0, 40.0]) == pytest.approx(0.005 + 0.0002 * 40, rel=1e-3)
    assert fit.predict(100, [1.0, 100.0]) == pytest.approx(0.005 + 0.0002 * 100, rel=1e-3)
    fit.add(100, [1.0, 100.0], 0.03)
    assert fit.fits[7].prior == pytest.approx(fit.fits[6].weights)
    with pytest.raises(ValueError, match="weights"):
        fit.set_weights([1.0])


def test_step_time_prices_passes_padding_and_tokens():
    c = StepCostModel()
    c.target.set_weights([1e-3, 0.0, 0.0, 1e-5, 1e-4, 3e-4])       # padding dominates tokens
    c.draft.set_weights([1e-4, 5e-4, 0.0, 0.0])
    c.overhead.set_weights([2e-4, 0.0])
    plain = c.step_time(32, 32, 0, 0)
    assert plain == pytest.approx(1.2e-3)
    one_long = c.step_time(32, 32, 4, 4)        # one sequence proposes 4, the rest nothing
    all_long = c.step_time(32, 32, 128, 4)
    # One long proposal already pays the draft's 4 passes, the padding of every row and
    # the target's verifying at all.
    assert one_long - plain == pytest.approx(4e-5 + 128 * 1e-4 + 1e-4 + 4 * 5e-4 + 3e-4)
    assert all_long - one_long == pytest.approx(124 * 1e-5)


def test_the_fit_tells_verifying_at_all_from_each_level():
    # The CPU pair at batch 1 (ms): the target's call 3.6 plain, 4.5 with one proposal,
    # 0.1 more per further one; the draft's 0.5 per call and 1.0 per pass. Early stops
    # make every level from 1 to 4, and the switch's trials a few plain steps.
    c = StepCostModel()
    rng = random.Random(3)
    for _ in range(200):
        m = rng.choice([0, 1, 1, 2, 2, 3, 3, 4, 4, 4])
        c.observe_target(1, 1, m, m, (3.6 + (0.8 + 0.1 * m if m else 0.0)) * 1e-3)
        if m:
            c.observe_draft(1, m, 1, m, (0.5 + 1.0 * m) * 1e-3)
        c.observe_overhead(1, 0.2e-3)
    price = c.price(1, 1)
    for m in range(5):
        truth = 3.8 + (1.3 + 1.1 * m if m else 0.0)
        assert price.time(m, m) * 1e3 == pytest.approx(truth, rel=0.02), m
    assert (price.per_pass + price.per_token) * 1e3 == pytest.approx(1.1, rel=0.05)


def test_the_fit_is_solved_again_once_a_32nd_of_its_window_is_new():
    fit = LinearFit(2, window=256)
    fit.add([1.0, 1.0], 0.0011)
    fit.add([1.0, 2.0], 0.0012)
    fit.add([1.0, 3.0], 0.0013)
    assert fit.version == 0 and fit.weights == [0.0, 0.0]
    fit.add([1.0, 4.0], 0.0014)                 # 2 per feature: solved at once
    assert fit.version == 1 and fit.weights == pytest.approx([0.001, 0.0001], rel=1e-6)
    for n in range(5, 257):
        fit.add([1.0, n % 9], 0.001 + 0.0001 * (n % 9))
    assert fit.solve() == pytest.approx([0.001, 0.0001], rel=1e-6)
    # The cost doubles. Seven more samples leave the weights as they were (a solve per
    # step was half of choose()'s time at batch 1); the eighth, a 32nd of a full window
    # of 256, brings a new solve.
    version = fit.version
    for n in range(7):
        assert not fit.add([1.0, n], 0.002 + 0.0002 * n)
    assert fit.version == version and fit.weights == pytest.approx([0.001, 0.0001], rel=1e-6)
    assert fit.add([1.0, 7.0], 0.002 + 0.0002 * 7)
    assert fit.version == version + 1 and fit.predict([1.0, 4.0]) > 0.001 + 0.0001 * 4 + 1e-5


def test_a_price_is_kept_until_the_weights_or_the_batch_change():
    c = StepCostModel()
    c.target.set_weights([1e-3, 0.0, 1e-5, 1e-5, 1e-4, 0.0])
    first = c.price(4, 4)
    assert c.price(4, 4) is first
    assert c.price(4, 8).plain == pytest.approx(first.plain + 4e-5)
    c.target.set_weights([2e-3, 0.0, 1e-5, 1e-5, 1e-4, 0.0])       # behind the model's back
    assert c.price(4, 4).plain == pytest.approx(first.plain + 1e-3)
    for _ in range(2 * len(StepCostModel.target_features(1, 1, 1, 1))):
        c.observe_target(4, 4, 0, 0, 0.01)
    # A new bucket's fit, once solved, prices its batch from its own samples.
    assert c.price(4, 4).plain == pytest.approx(0.01 + c.overhead.weights(4)[0] + 4 * c.overhead.weights(4)[1],
                                                rel=1e-3)
