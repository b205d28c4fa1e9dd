"""Counters behind ``SpecRuntime.metrics()``, accumulated over the runtime's life from
each step's outcome (``record``): the verdicts the scheduler applied, the phase times."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from specray.scheduler.step import StepOutcome


@dataclass
class SpecStats:
    num_speculative_tokens: int
    num_steps: int = 0
    num_seq_steps: int = 0           # one per sequence per step
    num_emitted_tokens: int = 0      # accepted + the target's own token, per sequence-step
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_preemptions: int = 0
    num_requests_finished: int = 0
    busy_s: float = 0.0              # wall time spent inside steps
    draft_s: float = 0.0             # inside the proposer call (all k passes, messaging included)
    verify_s: float = 0.0            # inside the target call (forward, sampler, messaging)
    draft_compute_s: float = 0.0     # the draft workers' own time (the slowest of each call)
    verify_compute_s: float = 0.0    # the target workers' own time
    merge_s: float = 0.0             # merging proposals into the target plans
    mask_s: float = 0.0              # structured output: host mask work, of the workers' compute
    num_draft_calls: int = 0
    schedule_s: float = 0.0
    num_spec_off_steps: int = 0      # steps in which no sequence proposed (with a proposer)
    num_draft_worker_failures: int = 0
    num_target_worker_failures: int = 0
    num_predrafted_windows: int = 0  # overlap: windows drafted ahead while the target verified
    num_predraft_windows_used: int = 0
    num_predraft_windows_dropped: int = 0
    draft_hidden_s: float = 0.0      # the pre-drafts' draft time that ran behind verification
    last_mean_proposal_len: float = 0.0
    # Per draft position j = 1..num_speculative_tokens (index j - 1): proposals verified
    # at position j, and of those the accepted ones (acceptance stops at the first miss).
    proposed_at: list[int] = field(default_factory=list)
    accepted_at: list[int] = field(default_factory=list)
    started_at: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        self.proposed_at = [0] * self.num_speculative_tokens
        self.accepted_at = [0] * self.num_speculative_tokens

    def record(self, outcome: StepOutcome) -> None:
        """One step: its verdicts, what the scheduler planned, and where its time went."""
        self.num_steps += 1
        self.num_seq_steps += len(outcome.verdicts)
        self.num_emitted_tokens += outcome.emitted
        self.num_draft_tokens += outcome.proposed
        self.num_accepted_tokens += outcome.accepted
        if self.num_speculative_tokens:
            for v in outcome.verdicts:
                self._record_positions(v.proposed, v.accepted)
        planned = sum(s.proposal_len for s in outcome.step.seqs)
        self.last_mean_proposal_len = planned / len(outcome.step.seqs) if outcome.step.seqs else 0.0
        if self.num_speculative_tokens and planned == 0:
            self.num_spec_off_steps += 1
        t = outcome.times
        self.busy_s += t.step_s
        self.schedule_s += t.schedule_s
        if t.draft_s is not None:
            self.draft_s += t.draft_s
            self.draft_compute_s += min(t.draft_compute_s, t.draft_s)
            self.num_draft_calls += 1
        self.verify_s += t.verify_s
        # A worker's clock may run past the driver's by a hair; messaging is never negative.
        self.verify_compute_s += min(t.verify_compute_s, t.verify_s)
        self.merge_s += t.merge_s
        self.mask_s += t.mask_s
        o = outcome.overlap
        self.num_predrafted_windows += o.predrafted
        self.num_predraft_windows_used += o.used
        self.num_predraft_windows_dropped += o.dropped
        self.draft_hidden_s += o.hidden_s

    def _record_positions(self, proposed: int, accepted: int) -> None:
        """A verdict's proposals: positions 1..proposed were proposed, 1..accepted kept."""
        for j in range(proposed):
            self.proposed_at[j] += 1
        for j in range(accepted):
            self.accepted_at[j] += 1

    def as_dict(self) -> dict:
        d = self.num_draft_tokens
        s = self.num_seq_steps
        steps = self.num_steps
        messaging = (self.draft_s - self.draft_compute_s) + (self.verify_s - self.verify_compute_s)
        overhead = max(self.busy_s - self.schedule_s - self.merge_s - self.draft_s - self.verify_s, 0.0)
        return {
            "acceptance_rate": self.num_accepted_tokens / d if d else 0.0,
            "mean_accepted_length": self.num_emitted_tokens / s if s else 0.0,
            "system_efficiency": self.num_emitted_tokens / (s * (self.num_speculative_tokens + 1)) if s else 0.0,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "num_emitted_tokens": self.num_emitted_tokens,
            "num_steps": self.num_steps,
            "num_seq_steps": s,
            "num_preemptions": self.num_preemptions,
            "num_requests_finished": self.num_requests_finished,
            "tokens_per_s": self.num_emitted_tokens / self.busy_s if self.busy_s else 0.0,
            "busy_s": self.busy_s,
            "draft_s": self.draft_s,
            "verify_s": self.verify_s,
            "num_draft_calls": self.num_draft_calls,
            "schedule_s": self.schedule_s,
            "merge_s": self.merge_s,
            "mask_s": self.mask_s,
            "mean_mask_s": self.mask_s / steps if steps else 0.0,
            "draft_compute_s": self.draft_compute_s,
            "verify_compute_s": self.verify_compute_s,
            "messaging_s": messaging,
            # Update and bookkeeping: what a step costs besides scheduling, merging and its
            # worker calls.
            "driver_overhead_s": overhead,
            "num_spec_off_steps": self.num_spec_off_steps,
            "num_predrafted_windows": self.num_predrafted_windows,
            "num_predraft_windows_used": self.num_predraft_windows_used,
            "num_predraft_windows_dropped": self.num_predraft_windows_dropped,
            "draft_hidden_s": self.draft_hidden_s,
            # Of the draft's compute, the share that ran while the target verified.
            "draft_hidden_fraction": (self.draft_hidden_s / (self.draft_hidden_s + self.draft_compute_s)
                                      if self.draft_hidden_s + self.draft_compute_s else 0.0),
            "num_draft_worker_failures": self.num_draft_worker_failures,
            "num_target_worker_failures": self.num_target_worker_failures,
            "mean_proposal_len": self.last_mean_proposal_len,
            # Per draft position j = 1..k (as vLLM reports it): accepted at j / proposed at j
            # (0.0 where nothing was proposed at j).
            "acceptance_by_position": [a / p if p else 0.0 for a, p in zip(self.accepted_at, self.proposed_at)],
            "mean_step_s": self.busy_s / steps if steps else 0.0,
            "mean_draft_s": self.draft_s / self.num_draft_calls if self.num_draft_calls else 0.0,
            "mean_verify_s": self.verify_s / steps if steps else 0.0,
            # Everything of a step but the workers' own compute, per step.
            "mean_overhead_s": (self.schedule_s + self.merge_s + messaging + overhead) / steps if steps else 0.0,
            "uptime_s": time.monotonic() - self.started_at,
        }
