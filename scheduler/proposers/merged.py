"""Two proposers merged per sequence, as one proposer: a model (the draft model, or a head
in the target's process, ``in_target``) and suffix decoding beside it
(``proposer="draft+suffix"``).

Both propose for every drafting sequence where the suffix's proposal could win, and each
rank hands back one proposal per sequence: the one expected to have more tokens accepted
(``specray.scheduler.proposal_choice``: the suffix's own scores against the model's
measured acceptance, ``DraftRecord``). What the model does not need to propose it is not
asked: a sequence whose suffix proposal scores more than the model's whole proposal could
has ``proposal_len`` 0 in the model's plan (the model still runs its catch-up pass, so
its cache stays current; the other passes, most of its cost, skip it).

The choice reads only the model's record and the suffix's counts, never the model's
sampled tokens, so each verified proposal is still a draw from its own proposer and the
rejection sampler keeps the target's distribution. A sequence whose model rank was lost
verifies without proposals that step, as with the model alone.

After the verdicts (``observe``): the model's record learns from the proposals of its
that were verified; suffix decoding judges all its proposals, verified or not; and where
the suffix's proposal was verified instead of the model's, the model has still cached its
own proposals but the last, of which only as many as the emitted tokens start with hold
(``StepOutcome.draft_kept``).
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

from specray.scheduler.messages import Proposals, StepPlan
from specray.scheduler.proposal_choice import DraftRecord, common_prefix, pick_shards
from specray.scheduler.proposers.proposer import Proposer, Shard

if TYPE_CHECKING:
    from specray.scheduler.proposers.suffix import SuffixProposer
    from specray.scheduler.sequence import Sequence
    from specray.scheduler.step import StepOutcome


class MergedProposer(Proposer):
    def __init__(self, model: Proposer, suffix: SuffixProposer, record: DraftRecord | None = None) -> None:
        """``model``: the proposer whose proposals the record values (its ranks are this
        one's); ``suffix``: the scoring proposer beside it (``SuffixProposer``'s
        ``propose``, ``ceiling``, ``fade``)."""
        self.model = model
        self.suffix = suffix
        self.record = record if record is not None else DraftRecord()
        self.num_ranks = model.num_ranks
        # step id -> seq id -> (what the model cached of its proposal, whether its proposal
        # was the one kept): read by the step's ``observe``. Steps are kept apart: with two
        # groups in flight one is proposed for while the other is verified.
        self._asked: dict[int, dict[int, tuple[list[int], bool]]] = {}
        self._suffix_steps: set[int] = set()      # steps that asked suffix decoding anything

    def submit(self, rank: int, plan: StepPlan, seqs: list[Sequence]) -> Any:
        """Suffix decoding proposes (now: it is host work) for the sequences whose proposal
        could beat the model's, then the model is sent its plan, without the sequences
        the suffix's proposal beats outright."""
        beside = None
        if seqs:
            longest = max(s.proposal_len for s in seqs)
            worth = self.record.expected_upto(longest)      # the model's, by proposal_len
            ceiling = self.suffix.ceiling()
            could = [s for s in seqs if ceiling * s.proposal_len > worth[s.proposal_len]]
            if could:
                beside = self.suffix.propose(plan.step_id, could)
                self._suffix_steps.add(plan.step_id)
                plan = _leave_to_suffix(plan, beside, worth)
        return plan.step_id, self.model.submit(rank, plan, seqs), beside

    def wait(self, rank: int, handle: Any) -> Shard:
        """The model's proposals, with the suffix's in the rows where it was chosen."""
        step_id, own, beside = handle
        props, probs = self.model.wait(rank, own)
        picks = pick_shards(props.seq_ids, [props, beside] if beside is not None else [props], self.record)
        w = props.width
        asked = self._asked.setdefault(step_id, {})
        for r, sid in enumerate(props.seq_ids):
            n = props.proposal_lens[r]
            # The model cached its proposals but the last: the pass after it never ran.
            asked[sid] = (props.token_ids[r * w:r * w + max(n - 1, 0)], picks[sid] == 0)
        if beside is None or all(s == 0 for s in picks.values()):
            return props, probs
        return _with_rows(props, beside, picks), probs

    def observe(self, outcome: StepOutcome) -> None:
        step_id = outcome.step.step_id
        if step_id not in self._suffix_steps and any(outcome.step.draft_seqs):
            # A step that asked suffix decoding nothing: its evidence ages, so the choice
            # probes again later.
            self.suffix.fade()
        self.suffix.observe(outcome)
        asked = self._asked.pop(step_id, {})
        # What steps before this one left (they failed: no verdicts came) goes too.
        for old in [s for s in self._asked if s < step_id]:
            del self._asked[old]
        self._suffix_steps = {s for s in self._suffix_steps if s > step_id}
        for v in outcome.verdicts:
            if v.seq_id not in asked:
                continue
            cached, kept = asked[v.seq_id]
            if kept:
                self.record.observe(v.proposed, v.accepted)
            else:
                # The model is always fed at least the last emitted token (it needs its
                # logits), even where its cache happens to hold it already.
                outcome.draft_kept[v.seq_id] = min(common_prefix(cached, v.tokens), len(v.tokens) - 1)

    def finished(self, seq: Sequence) -> None:
        self.suffix.finished(seq)

    def forget(self, seq_ids: list[int]) -> None:
        self.suffix.forget(seq_ids)

    def alive(self, rank: int) -> bool:
        return self.model.alive(rank)

    def gone(self, rank: int) -> bool:
        return self.model.gone(rank)

    def close(self) -> None:
        self.model.close()

    def stats(self) -> dict:
        return {**self.model.stats(), **self.suffix.stats()}


def _leave_to_suffix(plan: StepPlan, beside: Proposals, worth: list[float]) -> StepPlan:
    """The model's plan with no proposals asked of the sequences whose suffix proposal
    scores more than the model's full proposal could: they would verify the suffix's
    anyway."""
    score = dict(zip(beside.seq_ids, beside.scores))
    lens = [0 if score.get(sid, 0.0) > worth[n] else n for sid, n in zip(plan.seq_ids, plan.proposal_lens)]
    return plan if lens == plan.proposal_lens else replace(plan, proposal_lens=lens)


def _with_rows(props: Proposals, beside: Proposals, picks: dict[int, int]) -> Proposals:
    """``props`` with the rows ``picks`` gives to ``beside`` (index 1) taken from it: the
    same grid, and those rows marked as carrying no probabilities (one-hot, where the
    model's rows say where their probabilities are or that the target makes them)."""
    w, bw = props.width, beside.width
    row_of = {sid: r for r, sid in enumerate(beside.seq_ids)}
    lens, tokens = list(props.proposal_lens), list(props.token_ids)
    rows = list(props.prob_rows) or (list(range(len(props.seq_ids))) if props.has_probs else [])
    for r, sid in enumerate(props.seq_ids):
        if picks[sid] != 1:
            continue
        b = row_of[sid]
        n = beside.proposal_lens[b]
        lens[r] = n
        tokens[r * w:(r + 1) * w] = beside.token_ids[b * bw:b * bw + n] + [-1] * (w - n)
        if rows:
            rows[r] = -1
    return replace(props, proposal_lens=lens, token_ids=tokens, prob_rows=rows,
                   num_prob_rows=(props.num_prob_rows or len(props.seq_ids)) if props.has_probs else 0,
                   compute_s=max(props.compute_s, beside.compute_s))
