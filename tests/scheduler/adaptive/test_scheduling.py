"""The adaptive policy in the real scheduler and engine (tests/engine_harness.py): newcomers
follow the draft's record, requests arriving together are valued as one batch, the policy
hears the draft's catch-up, a request alone reaches past k, and early stops keep the
bookkeeping exact."""

from __future__ import annotations

import pytest

from engine_harness import MIXED, add_requests, assert_matches_reference, build
from specray.scheduler.adaptive.acceptance import AcceptanceEstimate
from specray.scheduler.adaptive.config import AdaptiveConfig
from specray.scheduler.adaptive.draft_confidence import ConfidenceCalibration
from specray.scheduler.adaptive.policy import AdaptivePolicy
from specray_testing import FixedFloorPolicy


def adaptive(max_speculative_tokens: int | None = None, **kw):
    """A harness whose scheduler runs the adaptive policy (k = 4)."""
    policy = AdaptivePolicy(AdaptiveConfig(k=4, max_speculative_tokens=max_speculative_tokens))
    return build(k=4, policy=policy, lookahead=policy.lookahead, **kw)


def test_adaptive_newcomers_into_an_empty_batch_follow_the_drafts_record():
    # With nothing running, newcomers used to get k whatever the draft had been doing; an
    # adaptive scheduler now asks its policy what a fresh sequence earns.
    eng = adaptive()
    for _ in range(60):
        eng.sched.policy.observe_sequence(AcceptanceEstimate(), proposed=4, accepted=0)
    add_requests(eng, [(1, 12, 8), (2, 9, 8)])
    step = eng.sched.schedule()
    assert [s.proposal_len for s in step.seqs] == [0, 0]
    assert all(p is None for p in step.draft_plans)
    good = adaptive()
    add_requests(good, [(1, 12, 8)])
    assert [s.proposal_len for s in good.sched.schedule().seqs] == [good.sched.policy.fresh_k(4)] != [0]


def test_adaptive_newcomers_arriving_together_are_valued_as_one_batch():
    # Speculation pays at batch 1 and not at 64 (50 us per scored token against a 1 ms
    # step): 64 requests arriving together into an empty batch start without proposals,
    # and the draft is not asked to prefill their prompts; one alone proposes.
    eng = adaptive(max_num_seqs=64)
    cost = eng.sched.policy.cost
    cost.target.set_weights([1e-3, 0.0, 5e-5, 5e-5, 0.0, 0.0])
    cost.draft.set_weights([1e-4, 5e-5, 1e-5, 1e-5])
    cost.overhead.set_weights([0.0, 0.0])
    add_requests(eng, [(i, 6, 4) for i in range(1, 65)])
    step = eng.sched.schedule()
    assert len(step.seqs) == 64 and all(s.proposal_len == 0 for s in step.seqs)
    assert all(p is None for p in step.draft_plans)
    alone = adaptive(max_num_seqs=64)
    alone.sched.policy.cost = cost
    add_requests(alone, [(1, 6, 4)])
    assert [s.proposal_len for s in alone.sched.schedule().seqs] == [alone.sched.policy.fresh_k(3)] != [0]


def test_the_policy_hears_how_much_the_draft_caught_up_on():
    # Plain for the first steps, then proposing: the first proposing step feeds the draft
    # the whole context it never saw (prompt and output so far), which the policy is told
    # apart from the one token a drafting sequence feeds it in a steady step.
    eng = adaptive()
    pol = eng.sched.policy
    pol.fresh_k = lambda cap, num_seqs=1: 0
    calls, seen = [], []
    pol.choose = lambda caps, est, fed: [0] * len(caps) if len(calls) < 4 else list(caps)
    observe_step = pol.observe_step

    def record(num_seqs, fed, proposed, emitted, seconds, draft_catch_up=0, longest=None):
        calls.append((proposed, draft_catch_up))
        observe_step(num_seqs, fed, proposed, emitted, seconds, draft_catch_up)
    pol.observe_step = record
    eng.on_plan = lambda step: seen.append(step.seqs[0].num_tokens)
    ref = add_requests(eng, [(1, 10, 24)])
    eng.run()
    assert_matches_reference(eng, ref)
    first = next(i for i, (proposed, _) in enumerate(calls) if proposed)
    assert [c for _, c in calls[:first]] == [0] * first
    assert calls[first][1] == seen[first] - 1        # everything it skipped, less the steady token
    assert all(c <= 1 for _, c in calls[first + 1:])  # then one or two tokens per step
    assert len(calls) > first + 2


def test_a_sequence_alone_proposes_past_k_and_a_batch_stays_within_it():
    """max_speculative_tokens: alone, a sequence plans up to 8 proposals with floors (its
    draft stops where they stop paying) and 8 lookahead slots are reserved for it; once a
    second sequence runs, both stay within num_speculative_tokens (the step admitting it
    keeps the plan made for the first alone; the newcomer gets at most k). Outputs stay
    exact."""
    eng = adaptive(max_speculative_tokens=8)
    assert eng.sched.k == 8
    cost = eng.sched.policy.cost
    cost.target.set_weights([1e-3, 0.0, 1e-5, 1e-5, 0.0, 0.0])
    cost.draft.set_weights([1e-4, 1e-5, 1e-5, 1e-5])
    cost.overhead.set_weights([0.0, 0.0])
    plans = []
    eng.on_plan = lambda step: plans.append([p for p in step.draft_plans if p is not None and p.seq_ids])
    ref = add_requests(eng, [(1, 10, 120)])
    for _ in range(8):
        eng.step()
    alone = [p for ps in plans[1:] for p in ps]
    assert alone and all(p.k == 8 and p.proposal_lens == [8] and p.min_reach[0] > 0 for p in alone)
    ref.update(add_requests(eng, [(2, 6, 40)]))
    plans.clear()
    eng.run()
    assert_matches_reference(eng, ref)
    together = [p for ps in plans for p in ps if p.num_seqs == 2]
    assert together[0].proposal_lens == [8, 4]
    assert len(together) > 3 and all(p.k <= 4 and not p.min_reach for p in together[1:])
    # The first sequence outlives the second: alone again, it reaches past k again.
    assert any(p.k > 4 for ps in plans[-5:] for p in ps)
    assert eng.sched.stats.num_stopped_proposals > 0


def test_drafts_that_stop_early_keep_outputs_and_bookkeeping_exact():
    """The drafts get floors (sequences planned more than one proposal) and the reach map;
    where they stop, the driver counts what they cached from what they proposed, the
    policy hears each proposal's reported probability, and the stops are counted."""
    pol = FixedFloorPolicy(4, 0.5, calibration=ConfidenceCalibration())
    eng = build(k=4, policy=pol)
    plans = []
    eng.on_plan = lambda step: plans.extend(p for p in step.draft_plans if p is not None and p.seq_ids)
    ref = add_requests(eng, MIXED)
    eng.run()
    assert_matches_reference(eng, ref)
    for plan in plans:
        if any(k > 1 for k in plan.proposal_lens):
            assert plan.min_reach == [0.5 if k > 1 else 0.0 for k in plan.proposal_lens]
            assert len(plan.reach_map) == 10
        else:    # one proposal each: nothing to stop
            assert plan.min_reach == [] and plan.reach_map == []
    planned = sum(sum(p.proposal_lens) for p in plans)
    plans = [p for p in plans if p.min_reach]
    # Nothing was reported before the first step: a calibrated draft's map.
    assert plans[0].reach_map == pytest.approx([(b + 0.5) / 10 for b in range(10)])
    assert plans[-1].reach_map != plans[0].reach_map
    reported = [(s.proposed, s.accepted, s.confidence) for o in pol.outcomes for s in o.sequences
                if s.confidence is not None]
    assert len(reported) > 50 and all(len(conf) == n for n, _, conf in reported)
    # 0.9 x 0.9 stays above the floor, 0.3 does not: a draft stops at its first miss.
    assert all(conf[:-1] == [0.9] * (n - 1) for n, _, conf in reported)
    st = eng.sched.stats
    assert st.num_stopped_proposals > 0
    assert st.num_stopped_proposals == planned - st.num_draft_tokens
    assert pol.calibration.observations == len(reported)
