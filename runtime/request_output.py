"""What a caller gets back for one request."""

from __future__ import annotations

from dataclasses import dataclass, field

from specray.scheduler.token_logprob import TokenLogprob

__all__ = ["RequestOutput", "TokenLogprob"]


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None      # "stop" | "length" | None while running
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # One per entry of token_ids where SamplingParams.logprobs asked for them, else None.
    logprobs: list[TokenLogprob] | None = None
    # Of the prompt, the tokens whose KV came from the prefix cache (not computed) when the
    # request was admitted (a multiple of block_size; 0 with enable_prefix_caching off).
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
