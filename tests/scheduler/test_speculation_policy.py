"""The speculation policy in isolation: acceptance estimates, the online cost model, and
goodput-based choices under a controlled cost model."""

from __future__ import annotations

import pytest

from scheduler.speculation_policy import AcceptanceEstimate, LinearFit, SpeculationPolicy, StepCostModel, GoodputSwitch


def est(accepted: float, rejected: float) -> AcceptanceEstimate:
    return AcceptanceEstimate(accepted=accepted, rejected=rejected)


def controlled_cost(t_tok: float, d_pass: float = 5e-5, d_tok: float = 1e-5) -> StepCostModel:
    """Target: 1 ms + t_tok per token scored; draft: 0.1 ms + d_pass per pass + d_tok per token."""
    c = StepCostModel()
    c.target.weights = [1e-3, 0.0, t_tok, t_tok]
    c.draft.weights = [1e-4, d_pass, d_tok, d_tok]
    return c


def test_acceptance_estimate_counts_a_truncated_run_as_one_rejection():
    e = AcceptanceEstimate()
    e.observe(proposed=4, accepted=4, decay=1.0)
    e.observe(proposed=4, accepted=1, decay=1.0)
    assert (e.accepted, e.rejected) == (5, 1)
    assert e.rate(prior=0.5, prior_weight=0.0) == pytest.approx(5 / 6)
    e.observe(proposed=0, accepted=0, decay=1.0)
    assert e.steps_without_proposal == 1


def test_linear_fit_recovers_a_cost_model():
    fit = LinearFit(3)
    for n in range(1, 30):
        for tokens in (n, 2 * n, 5 * n):
            fit.add([1.0, n, tokens], 0.002 + 0.0001 * n + 0.00003 * tokens)
    assert fit.weights == pytest.approx([0.002, 0.0001, 0.00003], rel=1e-6, abs=1e-9)


def test_static_policy_uses_the_caps_and_disable_by_batch_size():
    p = SpeculationPolicy("static", 4, disable_by_batch_size=8)
    assert p.choose([4, 2, 0], [est(0, 9)] * 3, fed_tokens=3) == [4, 2, 0]
    assert p.choose([4] * 8, [est(9, 0)] * 8, fed_tokens=8) == [0] * 8


def test_adaptive_gives_good_drafts_k_max_and_bad_drafts_nothing():
    p = SpeculationPolicy("adaptive", 4, cost=controlled_cost(t_tok=1e-5))
    good, bad = est(50, 1), est(0, 50)
    assert p.choose([4, 4], [good, bad], fed_tokens=2) == [4, 0]


def test_goodput_turns_speculation_off_at_large_batch_and_on_again():
    # Scoring a token costs 50 us: cheap next to the 1 ms step at batch 2, ruinous at 256.
    p = SpeculationPolicy("adaptive", 4, cost=controlled_cost(t_tok=5e-5))
    mid = est(6, 4)   # a_i ~ 0.6
    small = p.choose([4] * 2, [mid] * 2, fed_tokens=2)
    large = p.choose([4] * 256, [mid] * 256, fed_tokens=256)
    assert sum(small) > 0
    assert large == [0] * 256
    again = p.choose([4] * 2, [mid] * 2, fed_tokens=2)
    assert again == small


def test_quiet_sequences_are_probed_together():
    p = SpeculationPolicy("adaptive", 4, probe_interval=3, cost=controlled_cost(t_tok=1e-5))
    bad, quiet, fresh = est(0, 50), est(0, 50), est(0, 50)
    bad.steps_without_proposal = quiet.steps_without_proposal = 3
    picks = [p.choose([4, 4, 4], [bad, quiet, fresh], fed_tokens=3) for _ in range(6)]
    # Every third call probes every sequence quiet for 3 steps, with one token; never past the cap.
    assert picks == [[0, 0, 0], [0, 0, 0], [1, 1, 0], [0, 0, 0], [0, 0, 0], [1, 1, 0]]
    assert p.choose([0, 0, 0], [bad, quiet, fresh], fed_tokens=3) == [0, 0, 0]


def test_choice_maximises_goodput_against_brute_force():
    import itertools

    cost = controlled_cost(t_tok=5e-5, d_pass=3e-4)
    p = SpeculationPolicy("adaptive", 3, probe_interval=10**9, cost=cost)
    ests = [est(9, 1), est(3, 3), est(1, 6)]
    caps = [3, 3, 2]
    rates = [e.rate(p.overall.rate(p.prior_acceptance)) for e in ests]

    def goodput(ks):
        gain = sum(sum(r ** j for j in range(k + 1)) for r, k in zip(rates, ks))
        return gain / cost.step_time(3, 3, sum(ks), max(ks))

    best = max(goodput(ks) for ks in itertools.product(*(range(c + 1) for c in caps)))
    assert goodput(p.choose(caps, ests, fed_tokens=3)) == pytest.approx(best, rel=0.02)


def test_bad_policy_settings_are_refused():
    with pytest.raises(ValueError, match="speculation_policy"):
        SpeculationPolicy("sometimes")
    with pytest.raises(ValueError, match="disable_by_batch_size"):
        SpeculationPolicy("static", 4, disable_by_batch_size=0)


def test_new_sequences_start_from_the_overall_acceptance():
    p = SpeculationPolicy("adaptive", 4, cost=controlled_cost(t_tok=5e-5))
    fresh = AcceptanceEstimate()
    assert sum(p.choose([4], [fresh], fed_tokens=1)) > 0       # the prior alone speculates
    seen = AcceptanceEstimate()
    for _ in range(40):                                       # the draft has been failing everyone
        p.observe(seen, proposed=4, accepted=0)
    assert p.overall.rate(p.prior_acceptance) < 0.1
    assert p.choose([4], [AcceptanceEstimate()], fed_tokens=1) == [0]


def test_failed_probes_back_off_and_a_success_resets():
    p = SpeculationPolicy("adaptive", 4, probe_interval=4, max_probe_interval=16, cost=controlled_cost(t_tok=5e-5))
    e = AcceptanceEstimate(accepted=0, rejected=50)
    for _ in range(4):
        p.observe(e, proposed=0, accepted=0)
    p.observe(e, proposed=1, accepted=0)          # a failed probe
    assert e.quiet_limit == 8
    for _ in range(8):
        p.observe(e, proposed=0, accepted=0)
    p.observe(e, proposed=1, accepted=0)
    assert e.quiet_limit == 16
    for _ in range(16):
        p.observe(e, proposed=0, accepted=0)
    p.observe(e, proposed=1, accepted=0)
    assert e.quiet_limit == 16                    # capped
    for _ in range(16):
        p.observe(e, proposed=0, accepted=0)
    p.observe(e, proposed=1, accepted=1)          # the draft is good again
    assert e.quiet_limit == 4


# -- the measured on/off switch -------------------------------------------------------------------

def drive_switch(sw: GoodputSwitch, n: int, steps: int, on_tps: float, off_tps: float) -> list[bool]:
    """Run ``steps`` decisions at batch ``n`` on a machine where a step emits ``n`` tokens
    at ``on_tps`` tokens/s with speculation and ``off_tps`` without."""
    made = []
    for _ in range(steps):
        on = sw.speculate(n)
        made.append(on)
        sw.observe(n, on, n, n / (on_tps if on else off_tps))
    return made


def test_switch_runs_the_mode_ahead_and_tries_the_other_ever_less_often():
    sw = GoodputSwitch(explore_every=16, max_explore_every=64)
    made = drive_switch(sw, 8, 400, on_tps=100.0, off_tps=50.0)
    assert made[:3] == [True] * 3 and made[3:6] == [False] * 3          # both modes measured first
    trials = [i for i, on in enumerate(made) if not on and i >= 6]
    gaps = [b - a for a, b in zip(trials, trials[1:])]
    assert gaps[:3] == [32, 64, 64]                                      # each confirmation doubles the wait
    assert sw.goodput(8, True) == pytest.approx(100.0) and sw.goodput(8, False) == pytest.approx(50.0)


def test_switch_drops_a_leader_that_slows_down_at_once():
    sw = GoodputSwitch(explore_every=16)
    drive_switch(sw, 32, 100, on_tps=900.0, off_tps=700.0)
    made = drive_switch(sw, 32, 200, on_tps=500.0, off_tps=700.0)  # e.g. the draft got worse
    # The running mode's own figure shows it: no trial needed.
    assert made.index(False) < 10
    assert 1 <= made[5:].count(True) <= 4


def test_switch_finds_a_loser_that_got_better_at_its_next_trial():
    sw = GoodputSwitch(explore_every=16, max_explore_every=64)
    drive_switch(sw, 4, 300, on_tps=300.0, off_tps=400.0)           # off leads, trials settle at 64
    made = drive_switch(sw, 4, 200, on_tps=600.0, off_tps=400.0)    # speculation pays now
    trials = [i for i, on in enumerate(made[:60]) if on]
    # A trial that beat the leader brings the next one back after the base wait, not a
    # doubled one; no single step flips the mode, a few consistent ones do.
    assert trials[0] <= 64 and all(b - a == 16 for a, b in zip(trials, trials[1:]))
    switched = "".join("1" if on else "0" for on in made).find("1" * 10)
    assert 0 <= switched <= 120 and made[switched:].count(False) <= 8


def test_switch_keeps_batch_sizes_apart():
    sw = GoodputSwitch(explore_every=16)
    for _ in range(100):
        for n, on_tps, off_tps in ((1, 150.0, 100.0), (32, 700.0, 850.0)):
            on = sw.speculate(n)
            sw.observe(n, on, n, n / (on_tps if on else off_tps))
    assert sw.speculate(1) or sw.speculate(1)                     # one of two may explore
    assert not (sw.speculate(32) and sw.speculate(32))
    assert sw.bucket(1) != sw.bucket(32) and sw.bucket(17) == sw.bucket(31)


def test_a_draining_batch_starts_each_bucket_from_its_neighbours_leader():
    sw = GoodputSwitch(explore_every=16)
    drive_switch(sw, 32, 60, on_tps=700.0, off_tps=900.0)          # off leads at 32-63
    made = drive_switch(sw, 20, 40, on_tps=500.0, off_tps=800.0)    # the batch drained to 16-31
    assert made[:16] == [False] * 16                                 # no re-measuring of both modes
    assert made[16] is True and made[17:].count(True) == 0           # its own trial, on schedule
    assert (sw.bucket(20), True) in sw._sums                          # which measured this bucket
    # Far buckets share nothing: batch 1 measures for itself.
    assert sw.speculate(1) is True


def test_policy_turns_speculation_off_where_the_switch_measured_it_slower():
    pol = SpeculationPolicy("adaptive", k_max=4)
    for _ in range(40):                     # measured: at batch 32 plain decoding wins
        ks = pol.choose([4] * 32, [AcceptanceEstimate(accepted=9, rejected=1) for _ in range(32)], 32)
        pol.observe_step(32, 32, sum(ks), 32 * (1 + 0.1 * sum(ks) / 32), 1.0 if sum(ks) else 0.5)
    decisions = [sum(pol.choose([4] * 32, [AcceptanceEstimate(accepted=9, rejected=1)] * 32, 32)) > 0
                 for _ in range(32)]
    assert decisions.count(True) <= 2
    # Batch 1 has its own figures: nothing measured there yet, so the cost model decides.
    assert sum(pol.choose([4], [AcceptanceEstimate(accepted=9, rejected=1)], 1)) > 0


def test_prefill_steps_and_static_policies_do_not_feed_the_switch():
    pol = SpeculationPolicy("adaptive", k_max=4)
    pol.observe_step(4, 400, 8, 12, 0.5)        # a prompt's prefill rode along: not a decode step
    assert pol.switch._sums == {}
    pol.observe_step(4, 4, 8, 12, 0.5)
    assert pol.switch._sums
    static = SpeculationPolicy("static", k_max=4)
    static.observe_step(4, 4, 8, 12, 0.5)
    assert static.switch._sums == {}
