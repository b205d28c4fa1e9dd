"""What clients see of their requests: whole steps only, as deltas (``poll``,
``poll_many``), whole outputs (``wait``), or progress to resume from (``wait_progress``);
and ``abort``. A mixin of ``DriverCore`` (``specray.runtime.driver.core``): it reads the
``Request`` table ``_requests`` under ``_cv`` and decodes text without it (a decode
costs as much as the output is long).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from specray.runtime.driver.replies import PollReply
from specray.runtime.driver.resume import Progress, WaitReply
from specray.runtime.driver.stop_strings import held_back
from specray.runtime.request_output import RequestOutput
from specray.scheduler.sequence import Sequence


@dataclass
class Request:
    seq: Sequence
    prompt: list[int]
    sent_tokens: int = 0
    sent_text: int = 0
    error: str | None = None
    stop_text_at: int | None = None    # where a matched stop string begins in the output text
    stop_checked: int = 0              # output tokens already searched for stop strings
    # What clients see: the output of whole steps only (the loop appends a step's tokens
    # without the lock, and a stop string may cut them after), so a client's output always
    # ends where a step ended: where a resumed request continues exactly.
    committed: int = 0                 # output tokens shown
    closed: bool = False               # the finish shown
    counts: tuple[int, int] = (0, 0)   # num_draft_tokens, num_accepted_tokens of the steps shown

    def commit(self) -> None:
        seq = self.seq
        self.committed, self.closed = seq.output_len, seq.finished
        self.counts = (seq.num_draft_tokens, seq.num_accepted_tokens)


@dataclass
class Shown:
    """A request's committed output, copied under the driver's lock: decoded after it."""

    request_id: str
    prompt: list[int]
    tokens: list[int]
    reason: str | None
    counts: tuple[int, int]
    logprobs: list | None
    stop_text_at: int | None
    stops: list[str]
    num_cached_tokens: int = 0


class Streams:
    def wait(self, request_ids: list[str], timeout: float = 1.0) -> list[RequestOutput] | None:
        """All outputs once every request has finished; None if the timeout passes first."""
        deadline = time.monotonic() + timeout
        with self._cv:
            while not all(self._requests[r].closed for r in request_ids):
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cv.wait(left)
            try:
                shown = [self._shown(self._requests[r]) for r in request_ids]
            finally:
                for r in request_ids:   # delivered (or failed): forget them either way
                    del self._requests[r]
        return [self._render(s) for s in shown]

    def wait_progress(self, request_ids: list[str], have: list[int], timeout: float = 1.0) -> WaitReply:
        """``wait`` for a client that can resume: the ids this driver does not hold are
        named (it restarted since), and at the timeout each request's whole steps past the
        ``have[i]`` output tokens its client holds come back, for it to resume from."""
        with self._cv:
            unknown = [r for r in request_ids if r not in self._requests]
        if unknown:
            return WaitReply(unknown=unknown)
        outs = self.wait(request_ids, timeout)
        if outs is not None:
            return WaitReply(outputs=outs)
        reply = WaitReply()
        with self._cv:
            for rid, n in zip(request_ids, have):
                req = self._requests.get(rid)
                if req is None or req.committed <= n or req.error:
                    continue
                seq, end = req.seq, req.committed
                lps = seq.logprobs[n:end] if seq.logprobs is not None else None
                reply.progress.append(Progress(rid, seq.output_tokens[n:end], lps, *req.counts,
                                               prompt_token_ids=None if n else list(req.prompt)))
        return reply

    def poll(self, request_id: str, timeout: float = 1.0) -> RequestOutput | None:
        """The new part of a request's output since the last poll (None: nothing new yet)."""
        deadline = time.monotonic() + timeout
        with self._cv:
            req = self._requests.get(request_id)
            if req is None:
                raise ValueError(f"unknown request_id {request_id!r}")
            while not self._has_news(req):
                if not self._wait_for_step(deadline):
                    return None
            try:
                shown = self._shown(req)
            except RuntimeError:
                del self._requests[request_id]
                raise
        full = self._render(shown)
        with self._cv:
            return self._delta(request_id, req, full)

    def poll_many(self, request_ids: list[str], timeout: float = 1.0) -> PollReply:
        """``poll`` for many requests in one call (an HTTP ingress serving many streams):
        returns once any of them has something new, or at the timeout."""
        deadline = time.monotonic() + timeout
        reply = PollReply()
        news: list[tuple[str, Request, Shown]] = []
        with self._cv:
            while True:
                for rid in request_ids:
                    req = self._requests.get(rid)
                    if req is None:
                        reply.unknown.append(rid)
                    elif self._has_news(req):
                        try:
                            news.append((rid, req, self._shown(req)))
                        except RuntimeError as e:
                            del self._requests[rid]
                            reply.errors[rid] = str(e)
                if news or reply.errors or reply.unknown or not self._wait_for_step(deadline):
                    break
        fulls = [self._render(shown) for _, _, shown in news]
        with self._cv:
            for (rid, req, _), full in zip(news, fulls):
                delta = self._delta(rid, req, full)
                if delta is not None:
                    reply.deltas.append(delta)
        return reply

    def abort(self, request_ids: list[str]) -> list[str]:
        """Stop these requests (a client went away): nothing more is delivered for them and
        their KV blocks are freed before the next step. Returns the ids it stopped; ids it
        does not hold, or that already finished, are passed over."""
        stopped = []
        with self._cv:
            for rid in request_ids:
                req = self._requests.pop(rid, None) if isinstance(rid, str) else None
                if req is None:
                    continue
                if not req.seq.finished:
                    self._aborted.append(req.seq)
                    stopped.append(rid)
            self._num_aborted += len(stopped)
            self._cv.notify_all()
        return stopped

    def decode_tokens(self, token_ids: list[int]) -> list[str]:
        """Each token's own text (what OpenAI's log-probabilities name tokens by)."""
        if self.tokenizer is None:
            return ["" for _ in token_ids]
        return [self.tokenizer.decode([int(t)]) for t in token_ids]

    def _has_news(self, req: Request) -> bool:
        return req.committed != req.sent_tokens or req.closed or req.error is not None

    def _wait_for_step(self, deadline: float) -> bool:
        """Wait (holding ``_cv``) until the loop ends a step; False once past ``deadline``."""
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        self._pollers += 1
        try:
            self._cv.wait(left)
        finally:
            self._pollers -= 1
        return True

    def _delta(self, request_id: str, req: Request, full: RequestOutput) -> RequestOutput | None:
        """The part of ``full`` (``req``'s output, rendered) not sent yet; forgets the
        request once it is finished. Called holding ``_cv``; None when a concurrent poll
        of the same request sent it all already."""
        if self._requests.get(request_id) is not req:
            return None
        tokens = full.token_ids[req.sent_tokens:]
        text = full.text[req.sent_text:]
        if not (tokens or text or full.finished):
            return None
        delta = RequestOutput(request_id, req.prompt, tokens, text, full.finish_reason, full.num_draft_tokens,
                              full.num_accepted_tokens,
                              full.logprobs[req.sent_tokens:] if full.logprobs is not None else None,
                              full.num_cached_tokens)
        req.sent_tokens = max(req.sent_tokens, len(full.token_ids))
        req.sent_text = max(req.sent_text, len(full.text))
        if full.finished:
            del self._requests[request_id]
        return delta

    def _shown(self, req: Request) -> Shown:
        """What clients may see of ``req`` (the steps committed), copied holding ``_cv``
        for ``_render`` to decode without it; RuntimeError with its own error for a
        request that failed."""
        seq = req.seq
        if req.error or (seq.finish_reason == "error"):
            raise RuntimeError(req.error or "request failed")
        end = req.committed
        return Shown(seq.request_id, req.prompt, seq.output_tokens[:end], seq.finish_reason if req.closed else None,
                      req.counts, list(seq.logprobs[:end]) if seq.logprobs is not None else None,
                      req.stop_text_at, seq.params.stop, seq.num_cached_tokens)

    def _render(self, shown: Shown) -> RequestOutput:
        """The output ``shown``, its text decoded (without the stop token that ended it,
        cut where a stop string began). While it runs, the text leaves out a tail that
        is an incomplete character or may yet become a stop string. Runs without
        ``_cv``: the decode and the search cost as much as the output is long."""
        tokens, reason = shown.tokens, shown.reason
        ended_by_token = reason == "stop" and shown.stop_text_at is None
        text_ids = tokens[:-1] if ended_by_token else tokens
        text = self.tokenizer.decode(text_ids, skip_special_tokens=True) if self.tokenizer else ""
        if shown.stop_text_at is not None:
            text = text[:shown.stop_text_at]
        if reason is None:
            text = text.rstrip("\ufffd")     # an incomplete UTF-8 character: sent whole later
            # A tail that may yet become a stop string is held until it does or does not.
            text = text[:len(text) - held_back(text, shown.stops)]
        return RequestOutput(shown.request_id, shown.prompt, list(tokens), text, reason, *shown.counts,
                             shown.logprobs, shown.num_cached_tokens)
