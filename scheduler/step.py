"""A step as data: what the scheduler plans (``ScheduledStep``), what the target's
verification says of each sequence (``Verdict``), and what the engine brings back
(``StepOutcome``), the one way back into the scheduler (``Scheduler.update``), its stats
and its policy."""

from __future__ import annotations

from dataclasses import dataclass, field

from specray.scheduler.messages import StepPlan, StepResult
from specray.scheduler.sequence import Sequence
from specray.scheduler.token_logprob import TokenLogprob


@dataclass
class ScheduledStep:
    step_id: int
    seqs: list[Sequence]                          # every scheduled sequence, oldest first
    target_plans: list[StepPlan | None]           # per target worker; None: nothing to send
    target_seqs: list[list[Sequence]]
    draft_plans: list[StepPlan | None] = field(default_factory=list)   # per draft worker
    draft_seqs: list[list[Sequence]] = field(default_factory=list)

    @property
    def target_fed(self) -> int:
        """Tokens the step feeds the target besides proposals."""
        return sum(sum(p.num_new) for p in self.target_plans if p is not None)

    @property
    def draft_fed(self) -> int:
        """Tokens fed to the drafts before their passes (catch-up included)."""
        return sum(sum(p.num_new) for p in self.draft_plans if p is not None)

    @property
    def num_drafting(self) -> int:
        return sum(len(p.seq_ids) for p in self.draft_plans if p is not None)


@dataclass(frozen=True)
class Verdict:
    """One sequence's step, as the target verified it: ``proposed`` proposals verified
    (at most its ``proposal_len``: a proposer may find fewer), ``accepted`` of them kept,
    and the ``tokens`` emitted (the accepted ones and the target's own next token);
    ``logprobs``, one per emitted token, where the request asked for them (else None)."""

    seq_id: int
    proposed: int
    accepted: int
    tokens: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] | None = None


def verdicts(plan: StepPlan, result: StepResult) -> list[Verdict]:
    """The target worker's result for ``plan`` as verdicts, checked against the plan: one
    per planned sequence, in plan order, none verifying more than it proposed."""
    if list(result.seq_ids) != list(plan.seq_ids):
        raise ValueError(f"StepResult of step {plan.step_id} answers sequences {list(result.seq_ids)}, "
                         f"the plan sent {list(plan.seq_ids)}")
    result.validate()
    asked = plan.logprobs or [-1] * plan.num_seqs
    given = result.num_top or [-1] * plan.num_seqs
    out, pos, lp, top = [], 0, 0, 0
    for i, sid in enumerate(plan.seq_ids):
        proposed, emitted = result.proposed[i], result.num_emitted[i]
        if proposed > plan.proposal_lens[i]:
            raise ValueError(f"sequence {sid} verified {proposed} proposals, {plan.proposal_lens[i]} were sent")
        # Fewer alternatives than asked only where the vocabulary is smaller than that.
        if (given[i] < 0) != (asked[i] < 0) or given[i] > asked[i]:
            raise ValueError(f"sequence {sid} asked for {asked[i]} logprobs, the result gives {given[i]}")
        tokens = tuple(result.token_ids[pos:pos + emitted])
        logprobs = None
        if given[i] >= 0:
            n = given[i]
            logprobs = tuple(
                TokenLogprob(t, result.logprobs[lp + j],
                             list(zip(result.top_ids[top + j * n:top + (j + 1) * n],
                                      result.top_logprobs[top + j * n:top + (j + 1) * n])))
                for j, t in enumerate(tokens))
            lp += emitted
            top += emitted * n
        out.append(Verdict(sid, proposed, emitted - 1, tokens, logprobs))
        pos += emitted
    return out


@dataclass
class StepTimes:
    """Where one step's time went (s): the driver's wall clock per phase, and the slowest
    worker's own compute in each call."""

    schedule_s: float = 0.0
    draft_s: float | None = None                  # None: no draft call this step
    merge_s: float = 0.0
    verify_s: float = 0.0
    draft_compute_s: float = 0.0
    verify_compute_s: float = 0.0
    mask_s: float = 0.0                           # structured output's host masks (draft + target), of the computes
    step_s: float = 0.0                           # the whole step up to its update


@dataclass
class OverlapCounts:
    """Pre-drafting in one step: windows drafted ahead for the next step, pre-drafted
    windows this step used and dropped, and the pre-drafts' draft time hidden behind
    verification."""

    predrafted: int = 0
    used: int = 0
    dropped: int = 0
    hidden_s: float = 0.0


@dataclass
class StepOutcome:
    step: ScheduledStep
    verdicts: list[Verdict] = field(default_factory=list)   # every sequence the target verified
    lost_drafts: set[int] = field(default_factory=set)    # draft workers that failed in this step
    lost_targets: set[int] = field(default_factory=set)   # target workers that failed in this step
    times: StepTimes = field(default_factory=StepTimes)
    overlap: OverlapCounts = field(default_factory=OverlapCounts)
    # seq id -> how many of the draft model's cached proposals hold, for sequences whose
    # verified proposal came from another proposer (specray.scheduler.proposal_choice)
    draft_kept: dict[int, int] = field(default_factory=dict)

    @property
    def emitted(self) -> int:
        return sum(len(v.tokens) for v in self.verdicts)

    @property
    def proposed(self) -> int:
        return sum(v.proposed for v in self.verdicts)

    @property
    def accepted(self) -> int:
        return sum(v.accepted for v in self.verdicts)

    @property
    def longest(self) -> int:
        """The most any sequence proposed: the passes the drafts made."""
        return max((v.proposed for v in self.verdicts), default=0)

    @property
    def lost_workers(self) -> bool:
        """A worker failed in this step: its times mean little."""
        return bool(self.lost_drafts or self.lost_targets)
