"""The policy interface and static k: what a policy decides for running sequences and
newcomers, within each sequence's proposal_limit, and that the scheduler holds a policy to
those limits and shows it the same outcome its stats read."""

from __future__ import annotations

import pytest
from engine_harness import MIXED, add_requests, assert_matches_reference, build

from specray.scheduler.config import SpeculationConfig
from specray.scheduler.speculation_policy import Decision, PolicyView, StaticPolicy
from specray.scheduler.step import StepOutcome


def static(k: int = 4, **kw) -> StaticPolicy:
    return StaticPolicy(SpeculationConfig(num_speculative_tokens=k, **kw))


def test_static_proposes_k_within_each_limit():
    d = static(4).decide(PolicyView(seq_ids=[1, 2, 3], proposal_limits=[6, 2, 0], batch_size=3))
    assert d.proposal_lens == [4, 2, 0] and d.newcomer_proposal_len == 4


def test_static_disable_by_batch_size_counts_running_and_the_batch_newcomers_join():
    p = static(4, disable_by_batch_size=8)
    assert p.decide(PolicyView([1] * 8, [4] * 8, batch_size=8)).proposal_lens == [0] * 8
    # Seven running speculate; the newcomers that would make eight do not.
    d = p.decide(PolicyView([1] * 7, [4] * 7, batch_size=9))
    assert d.proposal_lens == [4] * 7 and d.newcomer_proposal_len == 0
    assert p.decide(PolicyView([], [], batch_size=3)).newcomer_proposal_len == 4


def test_static_settings_are_checked_once_in_their_config():
    with pytest.raises(ValueError, match="disable_by_batch_size"):
        SpeculationConfig(disable_by_batch_size=0)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        SpeculationConfig(num_speculative_tokens=-1)


class Greedy:
    """A policy that asks for more than any limit allows."""

    def decide(self, view: PolicyView) -> Decision:
        return Decision([c + 1 for c in view.proposal_limits], newcomer_proposal_len=99)

    def observe(self, outcome: StepOutcome) -> None:
        pass


def test_the_scheduler_refuses_a_decision_past_a_limit_and_clips_newcomers():
    eng = build(k=3, policy=Greedy())
    add_requests(eng, [(1, 5, 20)])
    step = eng.sched.schedule()                      # a newcomer: clipped to its limit
    assert [s.proposal_len for s in step.seqs] == [3]
    eng.sched.update(eng.run_step(step))
    with pytest.raises(ValueError, match="proposal_lens"):
        eng.sched.schedule()


class Recorder(StaticPolicy):
    """Static k, keeping every view and outcome."""

    def __init__(self, k: int) -> None:
        super().__init__(SpeculationConfig(num_speculative_tokens=k))
        self.views: list[PolicyView] = []
        self.outcomes: list[StepOutcome] = []

    def decide(self, view):
        self.views.append(view)
        return super().decide(view)

    def observe(self, outcome):
        self.outcomes.append(outcome)


def test_the_policy_sees_each_step_once_before_and_once_after():
    pol = Recorder(4)
    eng = build(k=4, policy=pol)
    ref = add_requests(eng, MIXED[:8])
    eng.run()
    assert_matches_reference(eng, ref)
    st = eng.sched.stats
    assert len(pol.views) == len(pol.outcomes) == st.num_steps
    assert sum(len(o.verdicts) for o in pol.outcomes) == st.num_seq_steps
    assert sum(o.proposed for o in pol.outcomes) == st.num_draft_tokens == eng.counts.drafted
    assert sum(o.accepted for o in pol.outcomes) == st.num_accepted_tokens == eng.counts.accepted
    assert sum(o.emitted for o in pol.outcomes) == st.num_emitted_tokens
    assert {v.seq_id for o in pol.outcomes for v in o.verdicts} == set(ref)
    for view, outcome in zip(pol.views, pol.outcomes):
        assert all(0 <= c <= 4 for c in view.proposal_limits)
        assert all(v.proposed <= 4 and len(v.tokens) == v.accepted + 1 for v in outcome.verdicts)
        assert outcome.times.verify_s >= 0 and outcome.times.step_s >= outcome.times.verify_s
