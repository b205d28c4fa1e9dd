"""The adaptive policy in the real scheduler and engine (tests/engine_harness.py): newcomers
follow the draft's record, requests arriving together are valued as one batch, the policy
hears each step's outcome as the stats do, and outputs stay plain greedy decoding's."""

from __future__ import annotations

from engine_harness import MIXED, add_requests, assert_matches_reference, build

from specray.scheduler.adaptive.policy import AdaptivePolicy
from specray.scheduler.config import SpeculationConfig
from specray.scheduler.step import ScheduledStep, StepOutcome, Verdict


def adaptive(k: int = 4, **kw):
    """A harness whose scheduler runs the adaptive policy."""
    return build(k=k, policy=AdaptivePolicy.of(SpeculationConfig(num_speculative_tokens=k,
                                                                  speculation_policy="adaptive")), **kw)


def rejected_everywhere(policy: AdaptivePolicy, steps: int = 60) -> None:
    """The draft's record across sequences: every proposal of ``steps`` steps rejected
    (outcomes of a lost worker: their times do not reach the cost model)."""
    for i in range(steps):
        policy.observe(StepOutcome(ScheduledStep(i, [], [], []), [Verdict(1000 + i, 4, 0, (7,))], lost_targets={0}))


def test_adaptive_newcomers_into_an_empty_batch_follow_the_drafts_record():
    eng = adaptive()
    rejected_everywhere(eng.sched.policy)
    add_requests(eng, [(1, 12, 8), (2, 9, 8)])
    step = eng.sched.schedule()
    assert [s.proposal_len for s in step.seqs] == [0, 0]
    assert all(p is None for p in step.draft_plans)
    good = adaptive()
    add_requests(good, [(1, 12, 8)])
    assert [s.proposal_len for s in good.sched.schedule().seqs] == [good.sched.policy.fresh_len(1)] != [0]


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
    assert [s.proposal_len for s in alone.sched.schedule().seqs] == [alone.sched.policy.fresh_len(1)] != [0]


def frozen_cost(policy: AdaptivePolicy) -> None:
    """A 1 ms step with cheap proposals, kept from the fake workers' microsecond timings."""
    cost = policy.cost
    cost.target.set_weights([1e-3, 0.0, 1e-5, 1e-5, 0.0, 0.0])
    cost.draft.set_weights([1e-4, 5e-5, 1e-5, 1e-5])
    cost.overhead.set_weights([0.0, 0.0])
    cost.observe_target = cost.observe_draft = cost.observe_overhead = lambda *a: None


def test_the_policy_hears_every_step_and_keeps_state_only_for_running_sequences():
    eng = adaptive()
    pol = eng.sched.policy
    frozen_cost(pol)
    heard: list[StepOutcome] = []
    observe = pol.observe
    pol.observe = lambda outcome: (heard.append(outcome), observe(outcome))
    live: list[int] = []

    def check(step):
        # Before each step the policy holds counts only for sequences of its last view.
        assert set(pol.estimates) <= {s.seq_id for s in step.seqs} | set(live)
        live[:] = [s.seq_id for s in eng.sched.running]
    eng.on_plan = check
    ref = add_requests(eng, MIXED[:10])
    eng.run()
    assert_matches_reference(eng, ref)
    st = eng.sched.stats
    assert len(heard) == st.num_steps
    assert sum(o.proposed for o in heard) == st.num_draft_tokens > 0
    assert sum(o.accepted for o in heard) == st.num_accepted_tokens
    # Per sequence, not one length for the batch: some step proposes unequal lengths.
    assert any(len({v.proposed for v in o.verdicts}) > 1 for o in heard)


def test_the_cost_model_is_fed_every_steps_phases():
    eng = adaptive()
    ref = add_requests(eng, MIXED[:4])
    eng.run()
    assert_matches_reference(eng, ref)
    fits = eng.sched.policy.cost
    assert sum(len(f.samples) for f in fits.target.fits.values()) == eng.sched.stats.num_steps


def test_adaptive_outputs_equal_plain_greedy_decoding_under_kv_pressure():
    eng = adaptive(max_model_len=64, target_blocks=24, draft_blocks=20)
    ref = add_requests(eng, MIXED)
    eng.run()
    assert_matches_reference(eng, ref)
    assert eng.sched.stats.num_preemptions > 0
