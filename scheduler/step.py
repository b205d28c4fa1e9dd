"""A step as data: what the scheduler plans (``ScheduledStep``) and what the engine brings
back (``StepOutcome``), the one way back into the scheduler (``Scheduler.update``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from specray.scheduler.messages import StepPlan, StepResult
from specray.scheduler.sequence import Sequence


@dataclass
class ScheduledStep:
    step_id: int
    seqs: list[Sequence]                          # every scheduled sequence, oldest first
    target_plans: list[StepPlan | None]           # per target worker; None: nothing to send
    target_seqs: list[list[Sequence]]
    draft_plans: list[StepPlan | None] = field(default_factory=list)   # per draft worker
    draft_seqs: list[list[Sequence]] = field(default_factory=list)


@dataclass
class StepOutcome:
    """Everything one step produced. The target plans carry the proposals merged into
    them (``StepPlan.proposal_token_ids`` / ``proposal_lens``: what the drafts made)."""

    step: ScheduledStep
    results: list[StepResult | None]              # per target worker; None where it had no plan or died
    lost_drafts: set[int] = field(default_factory=set)    # draft workers that failed in this step
    lost_targets: set[int] = field(default_factory=set)   # target workers that failed in this step
    # seq id -> the draft's probability of each of its proposals (drafts that stop early)
    confidence: dict[int, list[float]] = field(default_factory=dict)
    # Phase times (s): the driver's wall clock per phase, and the slowest worker's own compute.
    schedule_s: float = 0.0
    draft_s: float | None = None                  # None: no draft call this step
    merge_s: float = 0.0
    verify_s: float = 0.0
    draft_compute_s: float = 0.0
    verify_compute_s: float = 0.0
    step_s: float = 0.0                           # the whole step up to its update
    # Overlap: sequence windows pre-drafted for the next step, pre-drafted windows this
    # step used and dropped, and the pre-drafts' draft time hidden behind verification.
    predrafted: int = 0
    predraft_used: int = 0
    predraft_dropped: int = 0
    draft_hidden_s: float = 0.0
