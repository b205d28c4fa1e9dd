"""The adaptive policy in isolation: goodput-based proposal lengths under a controlled
cost model, against a brute-force search, and how its record of the draft moves them."""

from __future__ import annotations

import itertools

import pytest

from specray.scheduler.adaptive.acceptance import AcceptanceEstimate
from specray.scheduler.adaptive.config import AdaptiveConfig
from specray.scheduler.adaptive.policy import AdaptivePolicy
from specray.scheduler.adaptive.step_cost import StepCostModel
from specray.scheduler.config import SpeculationConfig
from specray.scheduler.speculation_policy import PolicyView
from specray.scheduler.step import ScheduledStep, StepOutcome, StepTimes, Verdict


def est(accepted: float, rejected: float) -> AcceptanceEstimate:
    return AcceptanceEstimate(accepted=accepted, rejected=rejected)


def controlled_cost(t_tok: float, d_pass: float = 5e-5, d_tok: float = 1e-5) -> StepCostModel:
    """Target: 1 ms + t_tok per token scored; draft: 0.1 ms + d_pass per pass + d_tok per token."""
    c = StepCostModel()
    c.target.set_weights([1e-3, 0.0, t_tok, t_tok, 0.0, 0.0])
    c.draft.set_weights([1e-4, d_pass, d_tok, d_tok])
    c.overhead.set_weights([0.0, 0.0])
    return c


def policy(k: int = 4, cost: StepCostModel | None = None, **spec) -> AdaptivePolicy:
    p = AdaptivePolicy.of(SpeculationConfig(num_speculative_tokens=k, speculation_policy="adaptive", **spec))
    if cost is not None:
        p.cost = cost
    return p


def test_adaptive_gives_good_drafts_k_and_bad_drafts_nothing():
    p = policy(cost=controlled_cost(t_tok=1e-5))
    good, bad = est(50, 1), est(0, 500)
    assert p.choose([4, 4], [good, bad], fed_tokens=2) == [4, 0]


def test_goodput_turns_speculation_off_at_large_batch_and_on_again():
    # Scoring a token costs 50 us: cheap next to the 1 ms step at batch 2, ruinous at 256.
    p = policy(cost=controlled_cost(t_tok=5e-5))
    mid = est(6, 4)   # a_i ~ 0.6
    small = p.choose([4] * 2, [mid] * 2, fed_tokens=2)
    large = p.choose([4] * 256, [mid] * 256, fed_tokens=256)
    assert sum(small) > 0
    assert large == [0] * 256
    assert p.choose([4] * 2, [mid] * 2, fed_tokens=2) == small


def test_choice_maximises_goodput_against_brute_force():
    cost = controlled_cost(t_tok=5e-5, d_pass=3e-4)
    p = policy(k=3, cost=cost)
    ests = [est(9, 1), est(3, 3), est(1, 6)]
    limits = [3, 3, 2]
    rates = p.rates(ests)

    def goodput(lens):
        gain = sum(sum(r ** j for j in range(m + 1)) for r, m in zip(rates, lens))
        return gain / cost.step_time(3, 3, sum(lens), max(lens))

    best = max(goodput(lens) for lens in itertools.product(*(range(c + 1) for c in limits)))
    assert goodput(p.choose(limits, ests, fed_tokens=3)) == pytest.approx(best, rel=0.02)


def test_one_unlucky_step_does_not_silence_a_sequence_among_alike_ones():
    # Sequences that all accept about 3 in 4, one of which had its first proposal
    # rejected: its own single observation alone (a_i = 0.375 with one pseudo-proposal of
    # the prior) would drop it to 0; leaning on the draft's rate across sequences does not.
    p = policy(cost=controlled_cost(t_tok=1e-5))
    p.overall = est(75, 25)
    unlucky = est(0, 1)
    lens = p.choose([4] * 17, [est(30, 10)] * 16 + [unlucky], fed_tokens=17)
    assert lens[-1] >= max(lens) - 1 > 0
    assert unlucky.rate(p.overall.rate(p.config.prior_acceptance), prior_weight=1.0) < 0.45


def test_bad_policy_settings_are_refused_naming_them():
    spec = SpeculationConfig(speculation_policy="adaptive")
    with pytest.raises(ValueError, match="decay"):
        AdaptiveConfig(spec, decay=0.0)
    with pytest.raises(ValueError, match="prior_acceptance"):
        AdaptiveConfig(spec, prior_acceptance=1.5)
    with pytest.raises(ValueError, match="no option 'measured_switch'"):
        AdaptivePolicy.of(SpeculationConfig(speculation_policy="adaptive", policy_options={"measured_switch": False}))
    assert AdaptivePolicy.of(SpeculationConfig(speculation_policy="adaptive",
                                               policy_options={"shrinkage": 4.0})).config.shrinkage == 4.0


def test_new_sequences_start_from_the_overall_acceptance():
    p = policy(cost=controlled_cost(t_tok=5e-5))
    assert sum(p.choose([4], [AcceptanceEstimate()], fed_tokens=1)) > 0      # the prior alone speculates
    assert p.fresh_len(1) > 0
    for _ in range(40):                                       # the draft has been failing everyone
        p.overall.observe(4, 0, p.config.overall_decay)
    assert p.overall.rate(p.config.prior_acceptance) < 0.1
    assert p.choose([4], [AcceptanceEstimate()], fed_tokens=1) == [0]
    assert p.fresh_len(1) == 0


def test_newcomers_arriving_together_are_valued_at_the_batch_they_form():
    # Scoring a token costs 50 us: speculation pays for one sequence, not for 256 at once.
    p = policy(cost=controlled_cost(t_tok=5e-5))
    assert p.fresh_len(1) > 0
    assert p.fresh_len(256) == 0


def test_decide_follows_the_view_and_keeps_counts_only_for_its_sequences():
    p = policy(cost=controlled_cost(t_tok=1e-5), disable_by_batch_size=8)
    d = p.decide(PolicyView(seq_ids=[1, 2], proposal_limits=[4, 1], fed_tokens=2, batch_size=3))
    assert d.proposal_lens[0] > 1 and d.proposal_lens[1] == 1
    assert d.newcomer_proposal_len == round(sum(d.proposal_lens) / 2)      # the running batch's mean
    step = ScheduledStep(1, [], [], [])
    p.observe(StepOutcome(step, [Verdict(1, 4, 0, (5,)), Verdict(2, 1, 1, (6, 7)), Verdict(3, 0, 0, (8,))],
                          times=StepTimes(verify_s=1e-3, step_s=2e-3)))
    assert set(p.estimates) == {1, 2}                  # 3 proposed nothing: nothing to count
    assert p.estimates[1].rejected == 1 and p.estimates[2].accepted == 1
    p.decide(PolicyView(seq_ids=[2, 4], proposal_limits=[4, 4], batch_size=2))
    assert set(p.estimates) == {2, 4}                  # 1 finished (or was preempted): forgotten
    # disable_by_batch_size: a full batch proposes nothing, nor do the newcomers that fill it.
    full = p.decide(PolicyView(seq_ids=list(range(8)), proposal_limits=[4] * 8, batch_size=9))
    assert full.proposal_lens == [0] * 8 and full.newcomer_proposal_len == 0


def test_the_cost_model_hears_each_steps_phases_but_not_a_lost_workers():
    p = policy()
    step = ScheduledStep(1, [], [], [])
    times = StepTimes(draft_s=1e-3, verify_s=2e-3, step_s=4e-3)
    outcome = StepOutcome(step, [Verdict(1, 4, 2, (5, 6, 7))], times=times)
    p.observe(outcome)
    assert sum(len(f.samples) for f in p.cost.target.fits.values()) == 1
    assert sum(len(f.samples) for f in p.cost.draft.fits.values()) == 1
    p.observe(StepOutcome(step, outcome.verdicts, lost_drafts={0}, times=outcome.times))
    assert sum(len(f.samples) for f in p.cost.target.fits.values()) == 1
    assert p.estimates[1].accepted > 2        # the verdicts still count


def test_quiet_steps_reuse_the_last_choice(monkeypatch):
    import specray.scheduler.adaptive.policy as module
    from specray.scheduler.adaptive.level_choice import LevelChoices

    built = []
    monkeypatch.setattr(module, "LevelChoices", lambda *a: built.append(a) or LevelChoices(*a))
    p = policy(cost=controlled_cost(t_tok=1e-5))
    hopeless = [est(0, 30)] * 3                      # nobody proposes, nothing moves
    for _ in range(5):
        assert p.choose([4] * 3, hopeless, fed_tokens=3) == [0, 0, 0]
    assert len(built) == 1
    p.choose([4] * 3, [est(30, 0)] * 3, fed_tokens=3)     # any change: chosen again
    assert len(built) == 2
