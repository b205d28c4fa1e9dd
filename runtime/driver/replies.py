"""What the driver answers its clients (the Python handle, the HTTP ingress, the batch
job): plain dataclasses that cross Ray as values, and how a refused submit names its
request."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from specray.runtime.config import RuntimeConfig
from specray.runtime.request_output import RequestOutput

# A refused call names its first bad request so that callers can drop it and resubmit.
REQUEST_ERROR = re.compile(r"request (\d+): (.*)", re.S)


def request_error(i: int, why) -> str:
    return f"request {i}: {why}"


class Overloaded(RuntimeError):
    """The driver already holds ``max_pending`` unfinished requests. Nothing of the refused
    submit was admitted; retrying later is safe."""


@dataclass(frozen=True)
class DriverInfo:
    """What a client knows of a driver: its configuration, whole, and what the driver read
    from the models."""

    config: RuntimeConfig
    vocab_size: int
    max_model_len: int            # the window in force: the configured one or the models', the smaller
    eos_token_ids: list[int]
    has_tokenizer: bool
    has_chat_template: bool


@dataclass
class SubmitReply:
    request_ids: list[str]
    error: str | None = None
    overloaded: bool = False     # the requests were valid; the driver had no room for them
    seeds: list[int] = field(default_factory=list)   # each request's seed: its own, else the one drawn for it


@dataclass
class PollReply:
    """``poll_many``'s answer: the new part of each request that has one (finished ones
    last appear here with their ``finish_reason``), why each failed one failed, and the
    ids the driver does not hold (never submitted, delivered, or aborted)."""

    deltas: list[RequestOutput] = field(default_factory=list)
    errors: dict[str, str] = field(default_factory=dict)
    unknown: list[str] = field(default_factory=list)
