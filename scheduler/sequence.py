"""Per-request decoding state, as the driver sees it, and the token accounting of a
verified step (``Sequence.apply``). The words are ``specray.scheduler``'s glossary."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from specray.scheduler.sampling_params import SamplingParams
from specray.scheduler.token_logprob import TokenLogprob

if TYPE_CHECKING:
    from specray.scheduler.step import Verdict


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    seq_id: int
    request_id: str
    prompt_len: int
    tokens: list[int]            # the prompt, then every token emitted so far
    params: SamplingParams
    seed: int
    status: SequenceStatus = SequenceStatus.WAITING
    target_computed: int = 0     # num_computed on its target worker
    draft_computed: int = 0      # num_computed on its draft worker
    finish_reason: str | None = None
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_preemptions: int = 0
    # Set while a step is in flight: its length before the step, and its proposal_len.
    step_len: int = 0
    proposal_len: int = 0
    # Set while a prefill chunk is in flight: the tokens it feeds (0: the step feeds all
    # of tokens[num_computed:] and its emitted tokens count).
    chunk_len: int = 0
    # Which target / draft worker holds this sequence's KV (sticky while it runs).
    target_rank: int = 0
    draft_rank: int = 0
    stop_ids: frozenset[int] = field(default_factory=frozenset)
    # One per output token, where the request asked for logprobs (else None).
    logprobs: list[TokenLogprob] | None = field(default=None, init=False)
    # Prefix caching: the names of its full blocks of committed tokens, block 0 first, as
    # far as they were needed (``specray.scheduler.prefix_cache``), and of its prompt, the
    # tokens found cached when it was admitted before its first output.
    block_hashes: list[bytes] = field(default_factory=list, init=False)
    num_cached_tokens: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        if self.params.logprobs is not None:
            self.logprobs = []

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
        self.chunk_len = 0

    def truncate_output(self, output_len: int) -> None:
        """Keep the output's first ``output_len`` tokens (a stop string matched there):
        those a step emitted past it go, as plain decoding would never have produced
        them. Only for a sequence that ends now (its workers' KV is not truncated)."""
        if not 0 < output_len <= self.output_len:
            raise ValueError(f"truncate_output({output_len}) outside the output's {self.output_len} tokens")
        del self.tokens[self.prompt_len + output_len:]
        if self.logprobs is not None:
            del self.logprobs[output_len:]

    def apply(self, verdict: Verdict, max_model_len: int, draft_kept: int | None = None) -> list[int]:
        """A verified step's token accounting; returns the tokens appended (the verdict's,
        up to a stop). The rules, for a sequence of ``step_len`` tokens before the step:

        - its target cached the fed tokens and every proposal; of those the accepted ones
          hold: ``target_computed = step_len + accepted``;
        - its draft, if it drafted, cached the fed tokens and each proposal but the last
          (the pass after it never ran): ``draft_computed = step_len + min(accepted,
          proposed - 1)``; where another proposer's proposal was verified instead,
          ``draft_kept`` of the draft's cached proposals start the emitted tokens and hold;
        - its emitted tokens are appended until a stop token, ``max_tokens`` or
          ``max_model_len`` ends it; so are their logprobs, where it keeps them.
        """
        if (self.logprobs is None) != (verdict.logprobs is None):
            raise ValueError(f"sequence {self.seq_id} keeps logprobs: {self.logprobs is not None}, "
                             f"its verdict carries them: {verdict.logprobs is not None}")
        self.target_computed = self.step_len + verdict.accepted
        if self.proposal_len:
            kept = min(verdict.accepted, max(verdict.proposed - 1, 0)) if draft_kept is None else draft_kept
            self.draft_computed = self.step_len + kept
        self.num_draft_tokens += verdict.proposed
        self.num_accepted_tokens += verdict.accepted
        appended = []
        for t in verdict.tokens:
            self.tokens.append(t)
            appended.append(t)
            if t in self.stop_ids:
                self.finish_reason = "stop"
            elif self.output_len >= self.params.max_tokens or self.num_tokens >= max_model_len:
                self.finish_reason = "length"
            if self.finish_reason:
                self.status = SequenceStatus.FINISHED
                break
        if self.logprobs is not None:
            self.logprobs.extend(verdict.logprobs[:len(appended)])
        return appended
