"""The adaptive policy in isolation: goodput-based choices of k_i under a controlled
cost model, and level exploration."""

from __future__ import annotations

import pytest

from specray.scheduler.adaptive.acceptance import AcceptanceEstimate
from specray.scheduler.adaptive.config import AdaptiveConfig
from specray.scheduler.adaptive.policy import AdaptivePolicy
from specray.scheduler.adaptive.step_cost import StepCostModel


def est(accepted: float, rejected: float) -> AcceptanceEstimate:
    return AcceptanceEstimate(accepted=accepted, rejected=rejected)


def controlled_cost(t_tok: float, d_pass: float = 5e-5, d_tok: float = 1e-5) -> StepCostModel:
    """Target: 1 ms + t_tok per token scored; draft: 0.1 ms + d_pass per pass + d_tok per token."""
    c = StepCostModel()
    c.target.set_weights([1e-3, 0.0, t_tok, t_tok, 0.0, 0.0])
    c.draft.set_weights([1e-4, d_pass, d_tok, d_tok])
    c.overhead.set_weights([0.0, 0.0])
    return c


def test_adaptive_gives_good_drafts_k_and_bad_drafts_nothing():
    p = AdaptivePolicy(AdaptiveConfig(k=4), cost=controlled_cost(t_tok=1e-5))
    good, bad = est(50, 1), est(0, 50)
    assert p.choose([4, 4], [good, bad], fed_tokens=2) == [4, 0]


def test_goodput_turns_speculation_off_at_large_batch_and_on_again():
    # Scoring a token costs 50 us: cheap next to the 1 ms step at batch 2, ruinous at 256.
    p = AdaptivePolicy(AdaptiveConfig(k=4), cost=controlled_cost(t_tok=5e-5))
    mid = est(6, 4)   # a_i ~ 0.6
    small = p.choose([4] * 2, [mid] * 2, fed_tokens=2)
    large = p.choose([4] * 256, [mid] * 256, fed_tokens=256)
    assert sum(small) > 0
    assert large == [0] * 256
    again = p.choose([4] * 2, [mid] * 2, fed_tokens=2)
    assert again == small


def test_choice_maximises_goodput_against_brute_force():
    import itertools

    cost = controlled_cost(t_tok=5e-5, d_pass=3e-4)
    p = AdaptivePolicy(AdaptiveConfig(k=3), cost=cost)
    ests = [est(9, 1), est(3, 3), est(1, 6)]
    caps = [3, 3, 2]
    rates = p._rates(ests)

    def goodput(ks):
        gain = sum(sum(r ** j for j in range(k + 1)) for r, k in zip(rates, ks))
        return gain / cost.step_time(3, 3, sum(ks), max(ks))

    best = max(goodput(ks) for ks in itertools.product(*(range(c + 1) for c in caps)))
    assert goodput(p.choose(caps, ests, fed_tokens=3)) == pytest.approx(best, rel=0.02)


def test_one_unlucky_step_does_not_silence_a_sequence_among_alike_ones():
    # The measured failure: sequences that all accept about 3 in 4, one of which had its
    # first proposal rejected. Trusting its own single observation (a_i = 0.375 with one
    # pseudo-observation of the prior) dropped it to k = 0.
    import random

    rng = random.Random(0)
    p = AdaptivePolicy(AdaptiveConfig(k=4, explore_levels_every=0), cost=controlled_cost(t_tok=1e-5))
    batch = [AcceptanceEstimate() for _ in range(16)]
    for _ in range(30):
        for e in batch:
            accepted = next((j for j in range(4) if rng.random() > 0.75), 4)
            p.observe_sequence(e, proposed=4, accepted=accepted)
        p.choose([4] * 16, batch, fed_tokens=16)
    assert p.spread.weight > 10                        # they are alike: lean on the overall rate
    unlucky = AcceptanceEstimate()
    p.observe_sequence(unlucky, proposed=4, accepted=0)
    ks = p.choose([4] * 17, batch + [unlucky], fed_tokens=17)
    assert ks[-1] >= max(ks) - 1 > 0
    # Trusted as a lone observation, the same record silences it.
    assert unlucky.rate(p.overall.rate(p.config.prior_acceptance), prior_weight=1.0) < 0.45


def test_bad_policy_settings_are_refused():
    with pytest.raises(ValueError, match="disable_by_batch_size"):
        AdaptiveConfig(k=4, disable_by_batch_size=0)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        AdaptiveConfig(k=0)
    with pytest.raises(ValueError, match="decay"):
        AdaptiveConfig(decay=0.0)


def test_new_sequences_start_from_the_overall_acceptance():
    p = AdaptivePolicy(AdaptiveConfig(k=4), cost=controlled_cost(t_tok=5e-5))
    fresh = AcceptanceEstimate()
    assert sum(p.choose([4], [fresh], fed_tokens=1)) > 0       # the prior alone speculates
    seen = AcceptanceEstimate()
    for _ in range(40):                                       # the draft has been failing everyone
        p.observe_sequence(seen, proposed=4, accepted=0)
    assert p.overall.rate(p.config.prior_acceptance) < 0.1
    assert p.choose([4], [AcceptanceEstimate()], fed_tokens=1) == [0]


def test_every_few_speculating_steps_another_level_runs_in_turn():
    # With a draft pass at 0.5 ms, level 2 is best; every 4th choice runs another level,
    # nearest first (1, 3, then 4: a level two away is measured again too), each with
    # that level's own best k_i.
    p = AdaptivePolicy(AdaptiveConfig(k=4, explore_levels_every=4), cost=controlled_cost(t_tok=1e-5, d_pass=5e-4), overall=est(80, 20))
    p.switch.explore_every = 10**9                 # no on/off trials in the way
    picks = [p.choose([4] * 4, [est(8, 2)] * 4, fed_tokens=4) for _ in range(24)]
    assert [max(ks) for ks in picks] == [2, 2, 2, 1, 2, 2, 2, 3, 2, 2, 2, 4] * 2
    assert all(len(set(ks)) == 1 for ks in picks)
    # From the top level, down one at a time.
    top = AdaptivePolicy(AdaptiveConfig(k=4, explore_levels_every=2), cost=controlled_cost(t_tok=1e-5))
    assert [max(top.choose([4] * 4, [est(50, 1)] * 4, fed_tokens=4)) for _ in range(8)] == [4, 3, 4, 2, 4, 1, 4, 3]
    # Level 0 (off) is the switch's to measure, never a level trial.
    never = AdaptivePolicy(AdaptiveConfig(k=4, explore_levels_every=1), cost=controlled_cost(t_tok=1e-5, d_pass=2e-3))
    assert [sum(never.choose([4] * 4, [est(8, 2)] * 4, fed_tokens=4)) for _ in range(4)] == [0] * 4


def test_level_trials_back_off_while_the_level_keeps_losing():
    # Each trial a level loses doubles the slots until its next one (at most
    # max_level_wait): the trial slots (every 4th choice) then run levels 1, 3, 4 at
    # waits 1, 2, 4, 8 and are mostly left unused.
    def trials(p, n, rates):
        """The level run in each trial slot among the next n choices."""
        out = []
        for _ in range(n):
            level = max(p.choose([4] * 4, [rates] * 4, fed_tokens=4))
            if p._level_choices % p.config.explore_levels_every == 0:
                out.append(level)
        return out

    p = AdaptivePolicy(AdaptiveConfig(k=4, explore_levels_every=4, max_level_wait=8), cost=controlled_cost(t_tok=1e-5, d_pass=5e-4), overall=est(80, 20))
    p.switch.explore_every = 10**9
    slots = trials(p, 4 * 24, est(8, 2))
    assert slots == [1, 3, 4, 1, 3, 4, 2, 1, 3, 4] + [2] * 5 + [1, 3, 4] + [2] * 5 + [1]
    # A level that has been the best is tried at the first slot after it stops being it.
    assert max(p.choose([4] * 4, [est(5000, 1)] * 4, fed_tokens=4)) == 4
    assert trials(p, 4 * 2, est(8, 2)) == [4, 3]          # then level 3, due as before
    # max_level_wait=1: every slot runs a trial, as without backoff.
    flat = AdaptivePolicy(AdaptiveConfig(k=4, explore_levels_every=4, max_level_wait=1), cost=controlled_cost(t_tok=1e-5, d_pass=5e-4), overall=est(80, 20))
    flat.switch.explore_every = 10**9
    assert trials(flat, 4 * 12, est(8, 2)) == [1, 3, 4] * 4


def test_calibrated_depth_gains_make_deeper_proposals_worth_it():
    # The same sequences, the same costs: once deep proposals have been seen to be accepted
    # more often than a_i^j says, the policy proposes deeper.
    p = AdaptivePolicy(AdaptiveConfig(k=4, explore_levels_every=0), cost=controlled_cost(t_tok=1e-5, d_pass=5e-4), overall=est(80, 20))
    before = p.choose([4] * 4, [est(8, 2)] * 4, fed_tokens=4)
    for i in range(400):
        p.depth.observe(rate=0.8, proposed=4, accepted=4 if i % 5 else 0)
    after = p.choose([4] * 4, [est(8, 2)] * 4, fed_tokens=4)
    assert max(after) > max(before)


def test_a_fresh_sequence_gets_what_the_drafts_recent_record_earns():
    p = AdaptivePolicy(AdaptiveConfig(k=4), cost=controlled_cost(t_tok=1e-5))
    assert p.fresh_k(4) == 4                       # the prior: drafts are worth it here
    for _ in range(40):
        p.observe_sequence(AcceptanceEstimate(), proposed=4, accepted=0)
    assert p.fresh_k(4) == 0                       # the draft has been failing everyone
    assert p.switch._steps == {} and p._level_choices == 0


def test_newcomers_arriving_together_are_valued_at_the_batch_they_form():
    # Scoring a token costs 50 us: speculation pays for one sequence, not for 256 at once.
    p = AdaptivePolicy(AdaptiveConfig(k=4), cost=controlled_cost(t_tok=5e-5))
    assert p.fresh_k(4, num_seqs=1) > 0
    assert p.fresh_k(4, num_seqs=256) == 0
    # Where the model says speculation pays but the switch has measured it doing worse
    # than plain decoding at that batch size, newcomers start without it too.
    q = AdaptivePolicy(AdaptiveConfig(k=4), cost=controlled_cost(t_tok=1e-5))
    assert q.fresh_k(4, num_seqs=8) > 0
    for _ in range(5):
        q.switch.observe(8, True, tokens=20, seconds=0.01, predicted_seconds=0.001)
        q.switch.observe(8, False, tokens=8, seconds=0.001, predicted_seconds=0.001)
    assert q.fresh_k(4, num_seqs=8) == 0
    assert q.fresh_k(4, num_seqs=1) > 0            # batch 1 is measured apart


def test_depth_calibration_is_fed_the_rate_the_choice_assumed():
    # Observing a batch updates the overall rate sequence by sequence; the calibration
    # must compare each outcome with what the choice assumed, not with a rate that the
    # earlier sequences of the same step have already moved.
    p = AdaptivePolicy(AdaptiveConfig(k=4, explore_levels_every=0), cost=controlled_cost(t_tok=1e-5), overall=est(80, 20))
    batch = [est(8, 2), est(8, 2)]
    p.choose([4, 4], batch, fed_tokens=2)
    assumed = p._rates(batch)                            # as the choice saw them
    p.observe_sequence(batch[0], proposed=4, accepted=0)          # moves the overall rate
    p.observe_sequence(batch[1], proposed=4, accepted=0)
    assert p.depth.predicted[False][0] == pytest.approx(assumed[0] * p.depth.decay + assumed[1], rel=1e-9)
    assert all(e.assumed_rate is None for e in batch)


def test_quiet_steps_reuse_the_valuation_and_any_change_renews_it(monkeypatch):
    # A hopeless draft: speculation stays off, nobody proposes, and nothing the valuation
    # reads moves, so the gains are computed once; the batch's cross-section is counted
    # once too, not again on every quiet step.
    p = AdaptivePolicy(AdaptiveConfig(k=4), cost=controlled_cost(t_tok=5e-5))
    p.switch.explore_every = 10**9
    bad = [est(0, 40), est(1, 40)]
    calls = []
    gains = p.depth.gains
    monkeypatch.setattr(p.depth, "gains", lambda *a, **k: calls.append(1) or gains(*a, **k))
    for _ in range(10):
        assert p.choose([4, 4], bad, fed_tokens=2) == [0, 0]
        for e in bad:
            p.observe_sequence(e, proposed=0, accepted=0)
    assert len(calls) == 1 and p.spread.observations == 1
    # An outcome, a changed cap, a new price or a calibration change each count.
    p.observe_sequence(bad[0], proposed=1, accepted=0)
    p.choose([4, 4], bad, fed_tokens=2)
    p.choose([4, 3], bad, fed_tokens=2)
    p.depth.observe(rate=0.1, proposed=1, accepted=0)
    p.choose([4, 3], bad, fed_tokens=2)
    assert len(calls) == 4
    # A new price re-ranks the levels from the same gains.
    good = [est(60, 1), est(60, 1)]
    p.cost.target.set_weights([1e-3, 0.0, 1e-6, 5e-3, 0.0, 0.0])
    assert p.choose([4, 4], good, fed_tokens=2) == [0, 0]
    p.cost.target.set_weights([1e-3, 0.0, 1e-6, 1e-6, 0.0, 0.0])
    assert min(p.choose([4, 4], good, fed_tokens=2)) > 0
    assert len(calls) == 5


def test_a_sequence_alone_proposes_to_its_cap_and_its_draft_stops_where_proposing_stops_paying():
    """Alone in the batch a sequence proposes up to its cap: its draft's stop prices each
    proposal, knowing the draft's doubts, where the rate-based choice would stop short.
    Its floor is the break-even gain of one more proposal (the best level's expected
    tokens per second times a pass and a verified token) over its rate."""
    def cost():
        return controlled_cost(t_tok=1e-4, d_pass=4e-4)

    p = AdaptivePolicy(AdaptiveConfig(k=4), cost=cost())
    calm = AdaptivePolicy(AdaptiveConfig(k=4, stop_early=False), cost=cost())
    planned = calm.choose([4], [est(6, 4)], fed_tokens=1)
    assert 0 < planned[0] < 4                       # the rate alone would stop short
    fair = est(6, 4)
    assert p.choose([4], [fair], fed_tokens=1) == [4]
    assert calm.min_reach(fair) == 0.0
    price = p.cost.price(1, 1)
    a = fair.assumed_rate
    best = max((1 + sum(a ** j for j in range(1, m + 1))) / price.time(m, m) for m in range(1, 5))
    break_even = best * (price.per_token + price.per_pass)
    assert p.min_reach(fair) == pytest.approx(break_even / a)
    # A newcomer is rated by the draft's recent record across sequences.
    newcomer = AcceptanceEstimate()
    assert p.min_reach(newcomer) == pytest.approx(break_even / p._rates([newcomer])[0])

    # In a batch a pass is shared and the rule misprices it: the rate-based choice, no stops.
    assert p.choose([4, 4], [est(6, 4), est(6, 4)], fed_tokens=2) == calm.choose([4, 4], [est(6, 4), est(6, 4)], 2)
    assert p.min_reach(fair) == 0.0
    # Nor with speculation off.
    assert p.choose([4], [est(0, 50)], fed_tokens=1) == [0] and p.min_reach(fair) == 0.0


def test_a_sequence_alone_may_reach_past_k_and_a_batch_may_not():
    """max_speculative_tokens widens only the stopping draft's reach: a batch and a newcomer
    in a batch stay within k, whatever the scheduler's caps."""
    cheap = lambda: controlled_cost(t_tok=1e-5, d_pass=1e-5)      # noqa: E731
    p = AdaptivePolicy(AdaptiveConfig(k=4, max_speculative_tokens=8), cost=cheap())
    assert p.lookahead == 8
    good = est(50, 1)
    assert p.choose([8], [good], fed_tokens=1) == [8]
    assert p.stopping and 0 < p.min_reach(good) < 1
    assert p.choose([8, 8], [est(50, 1), est(50, 1)], fed_tokens=2) == [4, 4]
    assert not p.stopping
    assert p.choose([6, 3], [est(50, 1), est(50, 1)], fed_tokens=2) == [4, 3]
    # A newcomer alone too, its draft stopping early from its first step; not in a batch.
    assert p.fresh_k(8) == 8 and p.stopping and 0 < p.min_reach(AcceptanceEstimate()) < 1
    assert p.fresh_k(8, num_seqs=2) == 4
    # Without stops nothing is different alone: no draft would cut the tail.
    calm = AdaptivePolicy(AdaptiveConfig(k=4, max_speculative_tokens=8, stop_early=False), cost=cheap())
    assert calm.lookahead == 4 and calm.choose([8], [good], fed_tokens=1) == [4]
    with pytest.raises(ValueError, match="max_speculative_tokens 3 must be >= num_speculative_tokens 4"):
        AdaptivePolicy(AdaptiveConfig(k=4, max_speculative_tokens=3))


def test_the_calibration_learns_from_what_the_drafts_report():
    p = AdaptivePolicy(AdaptiveConfig(k=4))
    e = est(5, 5)
    for _ in range(50):
        p.observe_sequence(e, 3, 1, confidence=[0.95, 0.15, 0.15])
    m = p.reach_map()
    assert m[9] > 0.95 and m[1] < 0.05
    assert p.confidence.observations == 50
