"""What a caller gets back for one request."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None      # "stop" | "length" | None while running
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
