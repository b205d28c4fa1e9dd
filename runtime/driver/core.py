"""The driver: owns the scheduler and the workers, runs the step loop on its own thread,
and serves clients (submit, wait, stream polls, metrics) concurrently.

``DriverCore`` is the driver itself; ``Driver`` is the Ray actor around it (threaded:
client calls are answered while the loop thread waits on workers). With
``backend="local"`` the core runs the workers in-process (co-located mode, and tests
that exercise the whole path quickly without actors).
"""

from __future__ import annotations

import os
import random
import re
import threading
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace

import ray

from specray.runtime.chat import ChatPrompt, check_messages
from specray.runtime.config import RuntimeConfig
from specray.runtime.driver.prompt_bound import max_prompt_chars
from specray.runtime.driver.restarts import RestartLog
from specray.runtime.engine.core import Engine, StepFailed
from specray.runtime.engine.step_groups import GroupEngine, wants_groups
from specray.scheduler.policies import build_policy
from specray.runtime.request_output import RequestOutput
from specray.runtime.driver.resume import Progress, Resume, WaitReply
from specray.runtime.driver.stop_strings import held_back, stop_cut
from specray.runtime.transport.worker_pool import start_workers
from specray.scheduler.block_manager import BlockManager
from specray.scheduler.sampling_params import SamplingParams
from specray.scheduler.scheduler import Scheduler
from specray.scheduler.sequence import Sequence


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


@dataclass
class _Request:
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
class _Shown:
    """A request's committed output, copied under the driver's lock: decoded after it."""

    request_id: str
    prompt: list[int]
    tokens: list[int]
    reason: str | None
    counts: tuple[int, int]
    logprobs: list | None
    stop_text_at: int | None
    stops: list[str]


def _call_off(launch: Future, cancel: threading.Event) -> None:
    """Workers starting for a driver that then refused its configuration: call the start
    off (on Ray at once; in this process once the model it is loading is in) and release
    whatever it had already taken."""
    cancel.set()
    try:
        pool = launch.result()
    except BaseException:
        return          # called off, or failed as well: it released its own
    pool.release()


class DriverCore:
    def __init__(self, config: RuntimeConfig, backend: str = "ray", export_metrics: bool | None = None) -> None:
        """``backend``: "ray" (workers are actors), "hosted" (the actor layout: the target
        worker in this process, draft workers actors) or "local" (workers in this process,
        as in co-located mode and in tests); ``export_metrics``: publish on Ray's metrics
        API (default: with the ray backend)."""
        self.config = config
        self.layout = "colocated" if backend == "local" else "actors"
        policy = build_policy(config.speculation)      # bad policy options are refused before any start
        # The workers start first and load their models while this process reads configs
        # and the tokenizer (importing transformers alone takes seconds): each worker
        # bounds its own window by the models'.
        cancel = threading.Event()
        if backend in ("local", "hosted"):
            # Workers load in this process too: transformers imported from two threads at
            # once fails half-initialised, so it is imported here first.
            import specray.workers.target_worker  # noqa: F401
        with ThreadPoolExecutor(1, thread_name_prefix="specray-start") as ex:
            launch = ex.submit(start_workers, config, backend, cancel)
            try:
                draft_len = self._read_models(config)
            except BaseException:
                _call_off(launch, cancel)
                raise
            self.pool = launch.result()
        bs = config.cache.block_size
        draft_pools = [BlockManager(n, bs) for n in self.pool.draft_blocks] if self.pool.draft_blocks else None
        spec = config.speculation
        if spec.overlap is None:
            # Pre-draft wherever draft actors compute beside the target: not in this
            # process, nor over a compiled graph's channel (one step at a time).
            spec = replace(spec, overlap=backend != "local" and not config.cluster.compiled_graph)
        self.scheduler = Scheduler(config.cache, spec, self.max_model_len,
                                   [BlockManager(n, bs) for n in self.pool.target_blocks], draft_pools,
                                   draft_max_len=draft_len, num_proposers=len(self.pool.proposers), policy=policy)
        # Pre-drafts run while the target verifies where draft workers are actors; in
        # process (backend "local") they run in turn, computing the same windows.
        engine = GroupEngine if wants_groups(config, backend) else Engine
        self.engine = engine(self.scheduler, self.pool.verifiers, self.pool.proposers,
                             config.cluster.target_down_timeout_s, overlap=spec.overlap,
                             suffix=self.pool.suffix, suffix_beside_drafts=config.speculation.draft_model)
        self._rng = random.Random(config.seed)
        self._cv = threading.Condition()
        self._incoming: list[Sequence] = []
        self._aborted: list[Sequence] = []
        self._num_aborted = 0
        self._requests: dict[str, _Request] = {}
        # Stream polls waiting for tokens: the loop wakes waiters every step only while one
        # waits; ``wait`` callers need a wake-up only when a request ends (waking them every
        # step hands the GIL to a thread with nothing to do, a tenth of a batch-1 step).
        self._pollers = 0
        self._next_seq = 0
        self._stop = False
        self._last_error: str | None = None      # operators' view (metrics); a client sees its own request's
        self._num_failed_steps = 0
        self._num_failed_requests = 0
        self._exporter = None
        if export_metrics if export_metrics is not None else backend == "ray":
            from specray.runtime.driver.metrics_export import RayMetrics

            self._exporter = RayMetrics(config.cluster.name or "anonymous")
        self._thread = threading.Thread(target=self._loop, name="specray-step-loop", daemon=True)
        self._thread.start()

    def _read_models(self, config: RuntimeConfig) -> int | None:
        """The driver's own view of the models: vocabulary, window, EOS ids and the
        tokenizer; checks the pair agrees. Returns the draft's window (None without one)."""
        # Imported here, not at module level: the client process defines the driver actor
        # from this class and should not pay for torch and transformers (seconds per CLI call).
        from specray.workers import model_loader
        from specray.workers.vocabulary import check_pair

        def tokenizer_or_none(path: str):
            try:
                return model_loader.load_tokenizer(path)
            except Exception:
                return None

        model = config.model
        tcfg = model_loader.load_config(model.target)
        self.vocab_size = tcfg.vocab_size
        target_len = model_loader.max_model_len(tcfg)
        self.max_model_len = min(model.max_model_len or target_len, target_len)
        self.eos_ids = model_loader.eos_token_ids(tcfg)
        k = config.speculation.num_speculative_tokens
        if k >= self.max_model_len:
            raise ValueError(f"num_speculative_tokens {k} must be below max_model_len {self.max_model_len}")
        self.tokenizer = tokenizer_or_none(model.target)  # None: token-id prompts only
        # A text prompt longer than this cannot fit the window, whatever it is: refused
        # before tokenizing it (which costs as much as the text is long); None: no bound
        # is known for this tokenizer.
        self.max_prompt_chars = max_prompt_chars(self.tokenizer, self.max_model_len)
        draft_len = None
        if model.draft is not None:
            dcfg = model_loader.load_config(model.draft)
            # Vocabulary sizes may differ (padding); the token ids both score must agree.
            check_pair(model.target, model.draft, tcfg.vocab_size, dcfg.vocab_size, self.tokenizer,
                       tokenizer_or_none(model.draft) if self.tokenizer is not None else None)
            # The draft worker's window: its own, within the target's and max_model_len
            # (``ModelRunner``); a pre-draft reserves slots up to it.
            own = model_loader.max_model_len(dcfg)
            draft_len = min(self.max_model_len, own) if own else self.max_model_len
        return draft_len

    # -- client API ----------------------------------------------------------------
    def info(self) -> DriverInfo:
        return DriverInfo(self.config, self.vocab_size, self.max_model_len, list(self.eos_ids),
                          self.tokenizer is not None, bool(getattr(self.tokenizer, "chat_template", None)))

    def check(self, prompts: list, params: list) -> str | None:
        """What ``submit`` would refuse these requests for (``request i: ...``), admitting
        nothing: a caller feeding a large call in parts checks it whole first."""
        if not isinstance(prompts, list) or not isinstance(params, list) or len(prompts) != len(params):
            return "prompts and params must be lists of equal length"
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            try:
                self._prepare(prompt, p)
            except ValueError as e:
                return request_error(i, e)
        return None

    def submit(self, prompts: list, params: list, resumes: list | None = None) -> SubmitReply:
        """Validate every request first; admit all of them or none. ``resumes``: per
        request None or the ``Resume`` of one a client held when its driver died (it is
        admitted past ``max_pending``: it was accepted once)."""
        if not isinstance(prompts, list) or not isinstance(params, list) or len(prompts) != len(params):
            return SubmitReply([], "prompts and params must be lists of equal length")
        if resumes is not None and (not isinstance(resumes, list) or len(resumes) != len(prompts)):
            return SubmitReply([], "resumes must be a list as long as prompts")
        fresh = len(prompts) if resumes is None else sum(1 for r in resumes if r is None)
        with self._cv:
            # Before any work (tokenizing costs as much as the prompts are long): a driver
            # at its limit refuses at once. Checked again below, as others may submit meanwhile.
            refused = self._refusal(fresh, len(prompts))
        if refused is not None:
            return refused
        seqs = []
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            try:
                seqs.append(self._make_seq(prompt, p, resumes[i] if resumes else None))
            except ValueError as e:
                return SubmitReply([], request_error(i, e))
        with self._cv:
            refused = self._refusal(fresh, len(seqs))
            if refused is not None:
                return refused
            for seq, prompt, resume in seqs:
                req = self._requests[seq.request_id] = _Request(seq, prompt)
                if resume is not None:
                    # The client holds these tokens, and a stream this much of their text.
                    req.sent_tokens = req.stop_checked = req.committed = len(resume.token_ids)
                    req.sent_text = resume.text_len
                    req.counts = (seq.num_draft_tokens, seq.num_accepted_tokens)
                self._incoming.append(seq)
            self._cv.notify_all()
        return SubmitReply([s.request_id for s, _, _ in seqs], seeds=[s.seed for s, _, _ in seqs])

    def _refusal(self, fresh: int, n: int) -> SubmitReply | None:
        """Why a submit of ``n`` requests (``fresh`` of them not resumed) is refused now,
        if it is; called holding ``_cv``."""
        if self._stop:
            return SubmitReply([], "the runtime is shut down")
        # Bounded memory: the queue never holds more than max_pending unfinished requests.
        # Counted here (not kept as a running total) so no path that ends a request can
        # forget to decrement it; O(max_pending) per submit is microseconds.
        pending = sum(1 for r in self._requests.values() if not r.seq.finished)
        if fresh and pending + n > self.config.max_pending:
            return SubmitReply([], f"overloaded: {pending} requests pending, max_pending is "
                                   f"{self.config.max_pending}; this submit of {n} was refused, "
                                   "retry once some finish", overloaded=True)
        return None

    def _make_seq(self, prompt, params, resume: Resume | None = None) -> tuple[Sequence, list[int], Resume | None]:
        ids, params = self._prepare(prompt, params)
        if resume is not None:
            if not isinstance(resume, Resume):
                raise ValueError(f"resume must be a Resume, got {type(resume).__name__}")
            resume.check(params, self.vocab_size, self.max_model_len)
            ids = list(resume.prompt_token_ids)
        stops = set(params.stop_token_ids)
        if not params.ignore_eos:
            stops.update(self.eos_ids)
        seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        with self._cv:
            self._next_seq += 1
            sid = self._next_seq
        # A resumed request's sequence is the original's: same prompt, its output so far
        # (its KV is recomputed from tokens[0:], as after a preemption).
        seq = Sequence(seq_id=sid, request_id=f"{sid}-{uuid.uuid4().hex[:8]}", prompt_len=len(ids),
                       tokens=list(ids) + (resume.token_ids if resume else []), params=params, seed=seed,
                       stop_ids=frozenset(stops))
        if resume is not None:
            seq.num_draft_tokens, seq.num_accepted_tokens = resume.num_draft_tokens, resume.num_accepted_tokens
            if seq.logprobs is not None:
                seq.logprobs = list(resume.logprobs)
        return seq, list(ids), resume

    def _prepare(self, prompt, params) -> tuple[list[int], SamplingParams]:
        """A request's prompt ids and params, validated; no state changes (check() runs it
        on requests it does not admit)."""
        if isinstance(params, SamplingParams):
            params = SamplingParams(**asdict(params))          # re-validate what crossed the wire
        elif isinstance(params, dict):
            params = SamplingParams.from_dict(params)
        else:
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        if params.top_k >= self.vocab_size:
            params = replace(params, top_k=0)      # it keeps every token: the filter is off
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            if self.tokenizer is None:
                raise ValueError("prompt is a string but the target has no tokenizer; pass token ids")
            if self.max_prompt_chars is not None and len(prompt) > self.max_prompt_chars:
                raise ValueError(f"prompt has {len(prompt)} characters, more than max_model_len {self.max_model_len} "
                                 f"tokens can spell ({self.max_prompt_chars}): it leaves no room to generate")
            ids = self._tokenize(prompt)
        elif isinstance(prompt, ChatPrompt):
            messages = check_messages(prompt.messages)
            if self.tokenizer is None:
                raise ValueError("messages need the target's tokenizer and chat template; it has no tokenizer")
            from specray.workers.model_loader import encode_chat

            ids = encode_chat(self.tokenizer, messages)
        elif isinstance(prompt, (list, tuple)):
            ids = list(prompt)
            for t in ids:
                if isinstance(t, bool) or not isinstance(t, int):
                    raise ValueError(f"prompt token ids must be ints, got {type(t).__name__}")
        else:
            raise ValueError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        if not ids:
            raise ValueError("prompt is empty")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens; max_model_len {self.max_model_len} "
                             "leaves no room to generate")
        # max_tokens may reach past the window (chat's default is the window itself): the
        # request is served to the window's end and finishes with "length", as a sequence
        # that reaches it always does; SamplingParams bounds max_tokens itself.
        largest = max(self.scheduler.target_pools, key=lambda p: p.num_blocks)
        need = largest.blocks_needed(min(len(ids) + params.max_tokens, self.max_model_len))
        if need > largest.num_blocks:
            raise ValueError(f"prompt plus max_tokens needs {need} KV blocks, but a target worker holds only "
                             f"{largest.num_blocks}: lower max_tokens or raise num_kv_blocks")
        bad = [t for t in params.stop_token_ids if t >= self.vocab_size]
        if bad:
            raise ValueError(f"stop_token_ids entry {bad[0]} is outside the vocabulary")
        return ids, params

    def _tokenize(self, text: str) -> list[int]:
        from specray.workers.model_loader import encode_prompt

        return encode_prompt(self.tokenizer, text)

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
        news: list[tuple[str, _Request, _Shown]] = []
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

    def _has_news(self, req: _Request) -> bool:
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

    def _delta(self, request_id: str, req: _Request, full: RequestOutput) -> RequestOutput | None:
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
                              full.logprobs[req.sent_tokens:] if full.logprobs is not None else None)
        req.sent_tokens = max(req.sent_tokens, len(full.token_ids))
        req.sent_text = max(req.sent_text, len(full.text))
        if full.finished:
            del self._requests[request_id]
        return delta

    def _shown(self, req: _Request) -> _Shown:
        """What clients may see of ``req`` (the steps committed), copied holding ``_cv``
        for ``_render`` to decode without it; RuntimeError with its own error for a
        request that failed."""
        seq = req.seq
        if req.error or (seq.finish_reason == "error"):
            raise RuntimeError(req.error or "request failed")
        end = req.committed
        return _Shown(seq.request_id, req.prompt, seq.output_tokens[:end], seq.finish_reason if req.closed else None,
                      req.counts, list(seq.logprobs[:end]) if seq.logprobs is not None else None,
                      req.stop_text_at, seq.params.stop)

    def _render(self, shown: _Shown) -> RequestOutput:
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
                             shown.logprobs)

    def metrics(self, workers: bool = True) -> dict:
        """``workers``: also ask each model worker whether its steps replayed CUDA graphs
        (``worker_graphs``, one entry per worker, targets first; None where an actor did not
        answer), and their sums. The periodic export leaves that out: a dead actor would
        hold the step loop for the call's timeout."""
        m = self.scheduler.stats.as_dict()
        dead_drafts, dead_targets = self.engine.dead()
        m.update(num_waiting=len(self.scheduler.waiting), num_running=len(self.scheduler.running),
                 # accepted and not yet delivered (finished ones wait here for their caller)
                 num_requests_held=len(self._requests), max_pending=self.config.max_pending,
                 num_requests_aborted=self._num_aborted,
                 target_kv_blocks_used=[p.num_used_blocks for p in self.scheduler.target_pools],
                 target_kv_blocks_total=[p.num_blocks for p in self.scheduler.target_pools],
                 draft_kv_blocks_used=[p.num_used_blocks for p in self.scheduler.draft_pools],
                 draft_kv_blocks_total=[p.num_blocks for p in self.scheduler.draft_pools],
                 num_target_workers=len(self.pool.verifiers), num_draft_workers=len(self.pool.proposers),
                 draft_workers_down=sorted(self.scheduler.drafts_down),
                 target_workers_down=sorted(self.scheduler.targets_down),
                 draft_workers_dead=dead_drafts, target_workers_dead=dead_targets,
                 # workers whose steps run over a compiled graph's channel right now
                 num_compiled_workers=sum(c.compiled() for c in self.pool.verifiers + self.pool.proposers),
                 # and over a link of their own (``worker_link``)
                 num_linked_workers=sum(getattr(c, "linked", bool)() for c in self.pool.verifiers + self.pool.proposers),
                 num_speculative_tokens=self.config.speculation.num_speculative_tokens,
                 proposer=self.config.speculation.proposer, overlap=self.engine.book is not None,
                 layout=self.layout, num_group_steps=getattr(self.engine, "num_group_steps", 0),
                 # steps that raised (requeued, then narrowed down to the request that
                 # failed them) and the requests that failed, for any reason
                 num_failed_steps=self._num_failed_steps, num_requests_failed=self._num_failed_requests,
                 last_error=self._last_error)
        if self.pool.suffix is not None:
            m.update(self.pool.suffix.stats())
        if workers:
            graphs = self.pool.graph_stats()
            live = [g for g in graphs if g is not None]
            m.update(worker_graphs=graphs, graph_replays=sum(g["graph_replays"] for g in live),
                     eager_forwards=sum(g["eager_forwards"] for g in live),
                     graph_capture_failures=sum(g["graph_capture_failure"] is not None for g in live))
        return m

    def shutdown(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        self._thread.join(timeout=30)
        self.pool.release()

    # -- the step loop -------------------------------------------------------------
    def _loop(self) -> None:
        exported = True
        while True:
            with self._cv:
                while not self._stop and not self._incoming and not self.scheduler.has_work:
                    if not exported:
                        break
                    if self.engine.degraded:
                        # Idle with a worker lost: keep watching for it to come back.
                        self._cv.wait(timeout=0.25)
                        try:
                            self.engine.poll_workers()
                        except Exception as e:  # noqa: BLE001 - the loop must outlive it
                            self._last_error = f"{type(e).__name__}: {e}"
                    else:
                        self._cv.wait()
                if self._stop:
                    return
                incoming, self._incoming = self._incoming, []
                aborted, self._aborted = self._aborted, []
            for seq in incoming:
                self.scheduler.add(seq)
            if aborted:
                for seq in aborted:
                    self.scheduler.finish(seq, "abort")
                self.engine.forget(aborted)
            if not (incoming or self.scheduler.has_work):
                # Idle after work: export the final figures once, then sleep.
                self._export()
                exported = True
                continue
            sched = self.scheduler
            unfinished = len(sched.waiting) + len(sched.running)
            stepped = []
            try:
                stepped = self.engine.step()
            except StepFailed as e:
                # Nothing of the step was kept and its requests were requeued, but the one
                # it ran alone: that one fails, with its own error (``Quarantine``).
                self._num_failed_steps += 1
                self._last_error = str(e)
                if e.culprit is not None:
                    self._fail([e.culprit], str(e))
            except Exception as e:  # noqa: BLE001 - no step's own (every target worker dead): all fail
                self._last_error = f"{type(e).__name__}: {e}"
                self._fail(self.scheduler.abort_all("error"), self._last_error)
            self._match_stops(stepped)
            # A finished sequence leaves both queues (preemption only moves one across).
            if self._pollers or len(sched.waiting) + len(sched.running) < unfinished:
                with self._cv:
                    self._cv.notify_all()
            exported = False
            if self._exporter is not None and self._exporter.due():
                self._export()
                exported = True

    def _fail(self, seqs: list[Sequence], why: str) -> None:
        """These requests failed (their sequences are finished already): each is told
        ``why`` when its client next asks."""
        self.engine.forget(seqs)
        self._num_failed_requests += len(seqs)
        with self._cv:
            for seq in seqs:
                req = self._requests.get(seq.request_id)
                if req is not None:
                    req.error = why
                    req.closed = True

    def _match_stops(self, stepped: list[tuple[Sequence, list[int]]]) -> None:
        """End the sequences whose text now holds one of their stop strings; then show
        clients the step. The search (a decode of each output) runs without ``_cv``:
        between steps only this thread changes a sequence's tokens, and clients read no
        further than what was committed."""
        with self._cv:
            reqs = [(seq, appended, self._requests.get(seq.request_id)) for seq, appended in stepped]
        cuts, broken = [], []
        for seq, appended, req in reqs:
            if req is None or not appended or not seq.params.stop:
                continue
            out = seq.output_tokens
            try:
                cut = stop_cut(self._decode, out, req.stop_checked, seq.params.stop)
            except Exception as e:  # noqa: BLE001 - its text cannot be read: it fails alone
                broken.append((seq, f"stop strings: {type(e).__name__}: {e}"))
                continue
            req.stop_checked = len(out)
            if cut is not None:
                cuts.append((seq, req, cut))
        for seq, why in broken:
            self.scheduler.finish(seq, "error")
            seq.finish_reason = "error"
            self._fail([seq], why)
        ended = []
        with self._cv:
            for seq, req, (keep, begin) in cuts:
                req.stop_text_at = begin
                if not seq.finished:
                    ended.append(seq)                 # else EOS or length ended it in this step
                self.scheduler.finish(seq, "stop")
                seq.finish_reason = "stop"
                seq.truncate_output(keep)
            for seq, _, req in reqs:
                if req is not None:
                    req.commit()
        for seq in ended:
            self.engine.finished(seq)

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def _export(self) -> None:
        if self._exporter is None:
            return
        try:
            self._exporter.update(self.metrics(workers=False))
        except Exception as e:  # noqa: BLE001 - metrics must not stop the serving
            # Raised here, it ended the step loop: every request then waited for ever.
            self._last_error = f"metrics export: {type(e).__name__}: {e}"


class Driver(DriverCore):
    """The driver actor. Threaded, so stream polls and submits are answered while the
    step loop waits on workers."""

    def __init__(self, config: RuntimeConfig, backend: str, export_metrics: bool) -> None:
        # Ray hands the client only the text of an error raised while an actor is created,
        # so a refused configuration is kept and reported by info(), for the client to
        # raise as the ValueError it is.
        self.refused: str | None = None
        # Ray reruns this constructor when it restarts the actor (``driver_restarts``).
        self.restarts = RestartLog()
        try:
            super().__init__(config, backend, export_metrics)
        except ValueError as e:
            self.refused = str(e)
        self.restarts.ready()

    def info(self) -> DriverInfo | str:
        """The driver's info, or why it refused its configuration."""
        return self.refused if self.refused is not None else super().info()

    def pid(self) -> int:
        """This incarnation's process (tests kill it)."""
        return os.getpid()

    def metrics(self, workers: bool = True) -> dict:
        return {**super().metrics(workers), **self.restarts.metrics()}

    def _match_stops(self, stepped: list[tuple[Sequence, list[int]]]) -> None:
        super()._match_stops(stepped)
        if stepped:
            self.restarts.first_token()

    def shutdown(self) -> None:
        super().shutdown()
        self.restarts.clear()


RemoteDriver = ray.remote(max_concurrency=256)(Driver)
