"""Per-request decoding state, as the driver sees it.

Glossary:
- ``tokens``: prompt followed by every token emitted so far.
- ``target_computed`` / ``draft_computed``: how many leading ``tokens`` are in that
  worker's KV cache (the ``num_computed`` invariant). A step feeds each worker
  ``tokens[computed:]``; preemption or a restarted worker simply sets it to 0.
- ``proposal_len`` (k_i): draft tokens proposed for this sequence in the current step.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from specray.scheduler.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    seq_id: int
    request_id: str
    prompt_len: int
    tokens: list[int]
    params: SamplingParams
    seed: int
    status: SequenceStatus = SequenceStatus.WAITING
    target_computed: int = 0
    draft_computed: int = 0
    finish_reason: str | None = None
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_preemptions: int = 0
    # Set while a step is in flight: the length before the step and the planned k_i.
    step_len: int = 0
    proposal_len: int = 0
    # Which target / draft worker holds this sequence's KV (sticky while it runs).
    target_rank: int = 0
    draft_rank: int = 0
    stop_ids: frozenset[int] = field(default_factory=frozenset)

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def output_len(self) -> int:
        return len(self.tokens) - self.prompt_len

    @property
    def remaining(self) -> int:
        return self.params.max_tokens - self.output_len

    @property
    def output_tokens(self) -> list[int]:
        return self.tokens[self.prompt_len:]

    @property
    def finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def reset_computed(self) -> None:
        self.target_computed = 0
        self.draft_computed = 0
