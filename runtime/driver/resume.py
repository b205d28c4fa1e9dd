"""Resuming accepted requests after the driver restarts.

A request's continuation is fixed by its prompt, its parameters, its seed and the tokens
it has already emitted: sampling randomness is keyed by (seed, position), not by step
(``specray.workers.sampling``). So whoever holds a request's output so far can hand it to
a fresh driver, which continues it as if nothing happened. Here that is the client (the
``SpecRuntime`` handle, the HTTP ingress): the driver keeps no journal.

The contract, for a request the client holds as ``Tracked``:

- the driver returns the seed it gave the request at acceptance (``SubmitReply.seeds``),
  so a resubmission carries it even where the caller set none;
- what the client holds always ends at a step boundary (the driver shows a client only
  the tokens of whole steps, ``DriverCore`` commits them after each step): resumed there, a
  sampled request's steps propose at the same positions as before, so its tokens are the
  same (greedy ones are in any case);
- the resubmission (``Resume``) carries the original prompt's ids and the output held, so
  the new driver's ``Sequence`` has the original ``prompt_len``: ``max_tokens`` counts the
  tokens already emitted, ``RequestOutput.prompt_token_ids`` stays the prompt, the text is
  decoded from the whole output (stop strings spanning the resume point match, a tail held
  back from a stream stays held back), logprobs and the draft/accepted counts continue
  from what was held;
- the new driver recomputes the request's KV from ``tokens[0:]`` (its ``num_computed`` is
  0), as after a preemption.

No Ray and no torch here: the arithmetic is tested in milliseconds.
"""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass, field
from typing import Any

from specray.runtime.request_output import RequestOutput
from specray.scheduler.sampling_params import SamplingParams
from specray.scheduler.token_logprob import TokenLogprob


@dataclass
class Resume:
    """What a driver needs to continue a request where its client stopped receiving."""

    prompt_token_ids: list[int]
    token_ids: list[int]                         # output tokens held (whole steps)
    logprobs: list[TokenLogprob] | None = None   # one per held token, where the request asked for them
    text_len: int = 0                            # characters of output text a stream already sent
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    def check(self, params: SamplingParams, vocab_size: int, max_model_len: int) -> None:
        """ValueError naming the field where this cannot be the state of an unfinished
        request with ``params``."""
        for name in ("prompt_token_ids", "token_ids"):
            ids = getattr(self, name)
            if not isinstance(ids, list) or any(isinstance(t, bool) or not isinstance(t, int) for t in ids):
                raise ValueError(f"resume.{name} must be a list of token ids")
            bad = [t for t in ids if not 0 <= t < vocab_size]
            if bad:
                raise ValueError(f"resume.{name}: token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
        if not self.prompt_token_ids:
            raise ValueError("resume.prompt_token_ids is empty")
        if params.seed is None:
            raise ValueError("a resumed request needs its seed (SubmitReply.seeds)")
        if len(self.token_ids) >= params.max_tokens:
            raise ValueError(f"resume.token_ids holds {len(self.token_ids)} tokens: the request had finished "
                             f"(max_tokens {params.max_tokens})")
        if len(self.prompt_token_ids) + len(self.token_ids) >= max_model_len:
            raise ValueError("resume: prompt and output fill max_model_len: the request had finished")
        if (self.logprobs is None) != (params.logprobs is None) or (
                self.logprobs is not None and len(self.logprobs) != len(self.token_ids)):
            raise ValueError("resume.logprobs must hold one entry per token where the request asks for logprobs")
        for name in ("text_len", "num_draft_tokens", "num_accepted_tokens"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"resume.{name} must be an int >= 0")


@dataclass
class Progress:
    """An unfinished request's output past what its client held (``have`` tokens):
    whole steps only."""

    request_id: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    num_draft_tokens: int
    num_accepted_tokens: int
    prompt_token_ids: list[int] | None = None   # sent with a client's first progress (it held nothing)


@dataclass
class WaitReply:
    """``DriverCore.wait_progress``'s answer: every output once all have finished, else
    each unfinished request's progress; and the ids this driver does not hold (it
    restarted since they were submitted)."""

    outputs: list[RequestOutput] | None = None
    progress: list[Progress] = field(default_factory=list)
    unknown: list[str] = field(default_factory=list)


def with_seed(params: SamplingParams, seed: int) -> SamplingParams:
    """``params`` with the seed its driver gave it (the caller's own one is kept as is)."""
    return params if params.seed == seed else dataclasses.replace(params, seed=seed)


@dataclass
class Tracked:
    """One accepted request as its client holds it: enough to resubmit it exactly."""

    request_id: str                 # the id the caller knows (the first driver's)
    driver_id: str                  # the id the driver serving it knows now
    prompt: Any                     # as first submitted: text, token ids or a chat prompt
    params: SamplingParams          # with the driver's seed
    prompt_token_ids: list[int] | None = None      # known from the first delta or progress
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    text_len: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    def __post_init__(self) -> None:
        if self.params.logprobs is not None and self.logprobs is None:
            self.logprobs = []

    def add_delta(self, delta: RequestOutput) -> None:
        """A stream delta was passed on to the caller: it holds that much more."""
        self.prompt_token_ids = list(delta.prompt_token_ids)
        self.token_ids += delta.token_ids
        if self.logprobs is not None and delta.logprobs is not None:
            self.logprobs += delta.logprobs
        self.text_len += len(delta.text)
        self.num_draft_tokens, self.num_accepted_tokens = delta.num_draft_tokens, delta.num_accepted_tokens

    def add_progress(self, p: Progress) -> None:
        if p.prompt_token_ids is not None:
            self.prompt_token_ids = list(p.prompt_token_ids)
        self.token_ids += p.token_ids
        if self.logprobs is not None and p.logprobs is not None:
            self.logprobs += p.logprobs
        self.num_draft_tokens, self.num_accepted_tokens = p.num_draft_tokens, p.num_accepted_tokens

    def resubmission(self) -> tuple[Any, SamplingParams, Resume | None]:
        """(prompt, params, resume) for a fresh driver: the original request while
        nothing of it is held, else its prompt's ids and the output held."""
        if not self.token_ids or self.prompt_token_ids is None:
            return self.prompt, self.params, None
        return self.prompt_token_ids, self.params, Resume(
            list(self.prompt_token_ids), list(self.token_ids),
            list(self.logprobs) if self.logprobs is not None else None, self.text_len,
            self.num_draft_tokens, self.num_accepted_tokens)

    def output(self, out: RequestOutput) -> RequestOutput:
        """An output of the request under the id its caller knows."""
        out.request_id = self.request_id
        return out


class InFlight:
    """A client's accepted, undelivered requests, by the id the caller knows; safe to
    share between threads. ``epoch`` counts the resubmissions: a thread that saw a driver
    fail resumes only if nobody has since its call began."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.requests: dict[str, Tracked] = {}
        self.epoch = 0

    def add(self, ids: list[str], prompts: list, params: list[SamplingParams], seeds: list[int]) -> None:
        with self.lock:
            for rid, prompt, p, seed in zip(ids, prompts, params, seeds):
                self.requests[rid] = Tracked(rid, rid, prompt, with_seed(p, seed))

    def get(self, request_id: str) -> Tracked | None:
        with self.lock:
            return self.requests.get(request_id)

    def current(self, request_ids: list[str]) -> list[str]:
        with self.lock:
            return [self.requests[r].driver_id for r in request_ids]

    def forget(self, request_ids: list[str]) -> None:
        with self.lock:
            for r in request_ids:
                self.requests.pop(r, None)

    def received(self, request_id: str, polled_id: str, news: RequestOutput | Progress, delta: bool) -> bool:
        """Keep what a call for ``polled_id`` brought (a stream ``delta``, else a wait's
        progress), unless the request has moved since that call was made: then the driver
        now serving it was told less, and sends this part again, identical."""
        with self.lock:
            t = self.requests.get(request_id)
            if t is None or t.driver_id != polled_id:
                return False
            if delta:
                t.add_delta(news)
                if news.finished:        # delivered whole: nothing left to resume
                    del self.requests[request_id]
            else:
                t.add_progress(news)
            return True

    def resubmissions(self) -> tuple[list[Tracked], list, list[SamplingParams], list[Resume | None]]:
        with self.lock:
            tracked = list(self.requests.values())
            parts = [t.resubmission() for t in tracked]
        return tracked, [p[0] for p in parts], [p[1] for p in parts], [p[2] for p in parts]

    def moved(self, tracked: list[Tracked], new_ids: list[str]) -> None:
        """The resubmitted requests now have these driver ids."""
        with self.lock:
            for t, rid in zip(tracked, new_ids):
                t.driver_id = rid
            self.epoch += 1
