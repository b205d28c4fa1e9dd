"""How many tokens each sequence proposes: the interface between the scheduler and a
speculation policy, and the default policy, static k.

A policy is two calls, each a small dataclass in and out::

    decide(PolicyView) -> Decision     before a step is planned
    observe(PolicyOutcome) -> None     once its verdict is in

The scheduler reads nothing else of a policy. ``decide`` gets each running sequence's
cap (the most the limits allow: ``max_tokens``, both models' windows, the lookahead, a
draft worker that is down) and returns each one's ``proposal_len`` (k_i <= cap), the
length for sequences admitted in this step, and, for drafts that stop early, per-sequence
floors and the calibration they read (``StepPlan.min_reach`` / ``reach_map``).
``observe`` gets what the step did. A policy may keep state between the two; every
``decide`` is followed by one ``observe`` of the same step (or none, when the step failed).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol


@dataclass
class PolicyView:
    seq_ids: list[int]            # running sequences, oldest first
    caps: list[int]               # the most each may propose this step
    fed_tokens: int = 0           # tokens the running batch feeds the target besides proposals
    batch_size: int = 0           # the batch this step may reach once waiting requests join
    lookahead: int = 0            # the most any sequence may propose (max_speculative_tokens)


@dataclass
class Decision:
    proposal_lens: list[int]                               # per running sequence, <= its cap
    newcomer_len: int = 0                                  # each admitted sequence (<= its own cap)
    min_reach: list[float] = field(default_factory=list)   # per running sequence; empty: no early stops
    newcomer_min_reach: float = 0.0
    reach_map: list[float] = field(default_factory=list)   # the draft probability's calibration


@dataclass
class SequenceOutcome:
    seq_id: int
    proposed: int                         # proposals the target verified (a draft may stop short of k_i)
    accepted: int
    confidence: list[float] | None = None # the draft's probability of each proposal, when it reported them
    finished: bool = False


@dataclass
class PolicyOutcome:
    """One step, as a policy sees it. Times are the driver's wall clock (seconds)."""

    sequences: list[SequenceOutcome]      # every sequence the target verified, in step order
    target_fed: int = 0                   # tokens the verified plans fed the target besides proposals
    draft_fed: int = 0                    # tokens fed to the drafts (catch-up included)
    num_drafting: int = 0                 # sequences the drafts ran
    emitted: int = 0
    draft_s: float | None = None          # None: no draft call this step
    verify_s: float = 0.0
    step_s: float = 0.0
    lost_workers: bool = False            # a worker failed in this step: its times mean little
    forgotten: list[int] = field(default_factory=list)   # sequences ended without a verdict

    @property
    def proposed(self) -> int:
        return sum(s.proposed for s in self.sequences)

    @property
    def longest(self) -> int:
        return max((s.proposed for s in self.sequences), default=0)


class SpeculationPolicy(Protocol):
    def decide(self, view: PolicyView) -> Decision: ...
    def observe(self, outcome: PolicyOutcome) -> None: ...


@dataclass
class StaticPolicy:
    """k_i = k wherever the limits allow; nobody proposes once the batch reaches
    ``disable_by_batch_size``."""

    k: int = 4
    disable_by_batch_size: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.k, bool) or not isinstance(self.k, int) or self.k < 0:
            raise ValueError(f"num_speculative_tokens must be an int >= 0, got {self.k!r}")
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 1:
            raise ValueError(f"disable_by_batch_size must be >= 1, got {self.disable_by_batch_size}")

    def decide(self, view: PolicyView) -> Decision:
        limit = self.disable_by_batch_size
        ks = [0] * len(view.caps) if limit is not None and len(view.caps) >= limit else \
            [min(c, self.k) for c in view.caps]
        # Newcomers count the batch they join: requests arriving together into an empty
        # batch would otherwise all propose, and the draft prefill every prompt, in the
        # very step the limit exists to spare.
        return Decision(ks, newcomer_len=0 if limit is not None and view.batch_size >= limit else self.k)

    def observe(self, outcome: PolicyOutcome) -> None:
        pass
