"""Admission: a request's prompt and parameters validated, tokenized and made a
``Sequence``, all of a submit or none, within ``max_pending``. A mixin of ``DriverCore``
(``specray.runtime.driver.core``), whose state it reads and writes under ``_cv``:
``_requests``, ``_incoming``, ``_next_seq``; and the models' facts ``_read_models`` left:
``vocab_size``, ``max_model_len``, ``eos_ids``, ``tokenizer``, ``max_prompt_chars``.
"""

from __future__ import annotations

import uuid
from dataclasses import asdict, replace

from specray.runtime.chat import ChatPrompt, check_messages
from specray.runtime.driver.replies import SubmitReply, request_error
from specray.runtime.driver.resume import Resume
from specray.runtime.driver.streams import Request
from specray.scheduler.sampling_params import SamplingParams
from specray.scheduler.sequence import Sequence


class Admission:
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
                req = self._requests[seq.request_id] = Request(seq, prompt)
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
        if params.structured_output is not None:
            from specray.workers.grammar import check_for_model

            check_for_model(params.structured_output, self.config.model.target, self.vocab_size)
        return ids, params

    def _tokenize(self, text: str) -> list[int]:
        from specray.workers.model_loader import encode_prompt

        return encode_prompt(self.tokenizer, text)
