"""The merge of a model proposer and suffix decoding is itself a proposer
(``MergedProposer``): what it asks of each, the one proposal per sequence it hands back,
and what the verdicts teach it."""

from __future__ import annotations

import pytest

from specray.scheduler.merge import merge_proposals
from specray.scheduler.messages import Proposals, StepPlan
from specray.scheduler.proposal_choice import DraftRecord
from specray.scheduler.proposers.merged import MergedProposer
from specray.scheduler.proposers.proposer import Proposer
from specray.scheduler.sampling_params import SamplingParams
from specray.scheduler.sequence import Sequence
from specray.scheduler.step import ScheduledStep, StepOutcome, Verdict

WIDTH = 3


def seq(sid: int, tokens: list[int], proposal_len: int = WIDTH) -> Sequence:
    s = Sequence(seq_id=sid, request_id=str(sid), prompt_len=len(tokens), tokens=list(tokens),
                 params=SamplingParams(max_tokens=10), seed=sid)
    s.proposal_len, s.step_len = proposal_len, len(tokens)
    return s


def plan_of(seqs: list[Sequence], step_id: int = 7) -> StepPlan:
    n = len(seqs)
    return StepPlan(step_id=step_id, width=WIDTH, seq_ids=[s.seq_id for s in seqs], num_computed=[0] * n,
                    num_new=[1] * n, token_ids=[0] * n, num_slots=[9] * n,
                    proposal_lens=[s.proposal_len for s in seqs], temperature=[1.0] * n, top_k=[0] * n,
                    top_p=[1.0] * n, seeds=[0] * n)


class Model(Proposer):
    """Proposes 50, 51, ... for each sequence, with probabilities (a handle naming its rows)."""

    def __init__(self) -> None:
        self.plans: list[StepPlan] = []

    def submit(self, rank, plan, seqs):
        self.plans.append(plan)
        toks = [t for n in plan.proposal_lens for t in [50 + j for j in range(n)] + [-1] * (plan.width - n)]
        return Proposals(step_id=plan.step_id, width=plan.width, has_probs=True, seq_ids=list(plan.seq_ids),
                         proposal_lens=list(plan.proposal_lens), token_ids=toks), "probs-of-rank-0"

    def wait(self, rank, handle):
        return handle


class Suffix:
    """Scores fixed per sequence id; proposes 8, 9, ... up to each proposal_len."""

    def __init__(self, scores: dict[int, float]) -> None:
        self.scores, self.asked, self.faded, self.observed = scores, [], 0, []

    def propose(self, step_id, seqs):
        self.asked.append([s.seq_id for s in seqs])
        width = max(s.proposal_len for s in seqs)
        lens = [s.proposal_len for s in seqs]
        toks = [t for n in lens for t in [8 + j for j in range(n)] + [-1] * (width - n)]
        return Proposals(step_id=step_id, width=width, seq_ids=[s.seq_id for s in seqs], proposal_lens=lens,
                         token_ids=toks, scores=[self.scores[s.seq_id] for s in seqs])

    def ceiling(self):
        return 1.0

    def fade(self):
        self.faded += 1

    def observe(self, outcome):
        self.observed += [v.seq_id for v in outcome.verdicts]


def step_of(seqs, plan) -> ScheduledStep:
    return ScheduledStep(plan.step_id, seqs, [None], [[]], [plan], [seqs])


def test_the_merge_is_a_proposer_handing_back_one_proposal_per_sequence():
    # The model's record: 0.5 a token, so three proposals are worth 0.875, one 0.5.
    model, suffix = Model(), Suffix({1: 2.5, 2: 0.6, 3: 0.1})
    merged = MergedProposer(model, suffix, DraftRecord(prior=0.5, prior_weight=1.0))
    assert isinstance(merged, Proposer) and merged.num_ranks == model.num_ranks
    seqs = [seq(1, [1, 2]), seq(2, [3, 4]), seq(3, [5, 6])]
    plan = plan_of(seqs)
    props, probs = merged.wait(0, merged.submit(0, plan, seqs))
    # Sequence 1's suffix proposal beats the model's whole proposal: the model is not
    # asked for it (its catch-up pass still runs); 2 and 3 it proposes.
    assert model.plans[0].proposal_lens == [0, 3, 3] and model.plans[0].seq_ids == [1, 2, 3]
    assert probs == "probs-of-rank-0"
    assert props.proposal_lens == [3, 3, 3]
    assert props.token_ids == [8, 9, 10, 50, 51, 52, 50, 51, 52]
    assert props.prob_rows == [-1, 1, 2]          # the suffix's row is one-hot
    target = merge_proposals(plan, [props])
    assert target.draft_rows == [-1, 1, 2]

    # The verdicts: 1 (the suffix's) emitted 8, 7; 2 and 3 (the model's) accepted 1 and 0.
    outcome = StepOutcome(step_of(seqs, plan), [Verdict(1, 3, 1, (8, 7)), Verdict(2, 3, 1, (50, 6)),
                                                 Verdict(3, 3, 0, (4,))])
    merged.observe(outcome)
    assert suffix.observed == [1, 2, 3] and suffix.faded == 0
    # The model cached nothing of its (empty) proposal for 1; the record learnt from 2 and 3.
    assert outcome.draft_kept == {1: 0}
    assert merged.record.counts.accepted == pytest.approx(1 * 0.99 + 0)


def test_steps_in_flight_together_are_told_apart():
    """Two groups in flight: step 8 is proposed for before step 7's verdicts come; each
    step's verdicts are read against its own choices."""
    model, suffix = Model(), Suffix({1: 2.5, 2: 0.1})
    merged = MergedProposer(model, suffix, DraftRecord(prior=0.5, prior_weight=1.0))
    a, b = [seq(1, [1, 2])], [seq(2, [3, 4])]
    pa, pb = plan_of(a, 7), plan_of(b, 8)
    ha, hb = merged.submit(0, pa, a), merged.submit(0, pb, b)
    assert merged.wait(0, ha)[0].token_ids == [8, 9, 10] and merged.wait(0, hb)[0].token_ids == [50, 51, 52]
    oa = StepOutcome(step_of(a, pa), [Verdict(1, 3, 2, (8, 9, 5))])
    merged.observe(oa)
    assert oa.draft_kept == {1: 0} and merged.record.counts.accepted == 0       # the suffix's was verified
    ob = StepOutcome(step_of(b, pb), [Verdict(2, 3, 2, (50, 51, 5))])
    merged.observe(ob)
    assert ob.draft_kept == {} and merged.record.counts.accepted == 2           # the model's
    assert suffix.faded == 0


def test_a_step_that_asks_suffix_decoding_nothing_fades_its_evidence():
    model, suffix = Model(), Suffix({1: 0.0})
    merged = MergedProposer(model, suffix, DraftRecord(prior=0.99, prior_weight=100.0))
    suffix.ceiling = lambda: 0.1                      # it cannot beat the model anywhere
    seqs = [seq(1, [1, 2])]
    plan = plan_of(seqs)
    props, _ = merged.wait(0, merged.submit(0, plan, seqs))
    assert suffix.asked == [] and props.token_ids == [50, 51, 52] and not props.prob_rows
    merged.observe(StepOutcome(step_of(seqs, plan), [Verdict(1, 3, 3, (50, 51, 52, 53))]))
    assert suffix.faded == 1
