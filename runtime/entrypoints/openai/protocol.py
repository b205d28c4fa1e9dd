"""OpenAI's HTTP API for text generation, as plain values: a request body checked and
turned into specray requests (``parse_completion``, ``parse_chat``), and the response
bodies and stream chunks built from ``RequestOutput`` parts. No web framework here: the
ingress (``specray.runtime.entrypoints.openai.ingress``) moves these values over HTTP.

Each choice is one specray request: a body with several prompts and ``n`` samples is
``len(prompts) * n`` requests, choice ``i * n + j`` answering prompt ``i``'s ``j``-th
sample (OpenAI's numbering). Sample ``j`` of a request with a ``seed`` is seeded
``seed + j``: reproducible, and distinct between samples.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from specray.runtime.chat import ChatPrompt, check_messages
from specray.runtime.entrypoints.openai import structured, tool_calls
from specray.scheduler.sampling_params import SamplingParams

MAX_LOGPROBS = 5             # completions' ``logprobs`` (OpenAI's own limit)
MAX_TOP_LOGPROBS = 20        # chat's ``top_logprobs``
MAX_N = 128
MAX_CHOICES = 4096           # RuntimeConfig's default max_pending; the ingress passes its driver's

# Fields clients send with their default values; any other value asks for what specray
# does not do, and is refused rather than silently ignored.
_NEUTRAL = {"presence_penalty": 0, "frequency_penalty": 0, "logit_bias": None, "best_of": None, "echo": False,
            "suffix": None, "parallel_tool_calls": None, "functions": None, "function_call": None}


class ApiError(Exception):
    """An error answered in OpenAI's body: ``{"error": {message, type, param, code}}``."""

    def __init__(self, status: int, message: str, param: str | None = None, type_: str | None = None,
                 code: str | None = None, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type_ or {404: "not_found_error", 429: "rate_limit_error", 503: "service_unavailable"}.get(
            status, "invalid_request_error" if 400 <= status < 500 else "server_error")
        self.code = code
        self.retry_after_s = retry_after_s

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param)


@dataclass
class GenerationRequest:
    """One HTTP body as specray requests: ``prompts[c]`` and ``params[c]`` per choice."""

    kind: str                         # "completion" | "chat"
    model: str
    prompts: list
    params: list[SamplingParams]
    num_prompts: int
    n: int
    stream: bool = False
    include_usage: bool = False
    logprobs: int | None = None       # alternatives per token asked for (None: no logprobs)
    tool_call: dict | None = None     # the call the answer is constrained to (tool_calls.parse)
    created: int = field(default_factory=lambda: int(time.time()))
    id: str = ""

    @property
    def num_choices(self) -> int:
        return len(self.prompts)


def _get(body: dict, name: str, kinds: tuple, default=None):
    v = body.get(name, default)
    if v is None:
        return default
    if isinstance(v, bool) and bool not in kinds:
        raise bad(f"{name} must be {_kind_names(kinds)}, got a boolean", name)
    if not isinstance(v, kinds):
        raise bad(f"{name} must be {_kind_names(kinds)}, got {type(v).__name__}", name)
    return v


def _kind_names(kinds: tuple) -> str:
    names = {int: "an integer", float: "a number", str: "a string", bool: "a boolean", list: "a list",
             dict: "an object"}
    return " or ".join(dict.fromkeys(names.get(k, k.__name__) for k in kinds))


def _common(body: object, kind: str, served: str, max_model_len: int) -> tuple[dict, SamplingParams, int]:
    body, params, n, _ = _common_with_call(body, kind, served, max_model_len)
    return body, params, n


def _common_with_call(body: object, kind: str, served: str,
                      max_model_len: int) -> tuple[dict, SamplingParams, int, dict | None]:
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad("model is required: the served model's name (GET /v1/models)", "model")
    if model != served:
        raise ApiError(404, f"the model {model!r} does not exist; this server serves {served!r}", "model",
                       code="model_not_found")
    for name, neutral in _NEUTRAL.items():
        if name in body and body[name] not in (neutral, None) and not (neutral == 0 and body[name] == 0.0):
            raise bad(f"{name} is not supported by specray", name)
    max_tokens = _get(body, "max_completion_tokens", (int,)) if kind == "chat" else None
    if max_tokens is None:
        max_tokens = _get(body, "max_tokens", (int,))
    if max_tokens is None:
        # OpenAI's completions default is 16 tokens; chat runs to the end of the window.
        max_tokens = 16 if kind == "completion" else max_model_len
    elif max_tokens < 1:
        raise bad(f"max_tokens must be >= 1, got {max_tokens}", "max_tokens")
    n = _get(body, "n", (int,), 1)
    if not 1 <= n <= MAX_N:
        raise bad(f"n must be in [1, {MAX_N}], got {n}", "n")
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    elif not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise bad("stop must be a string or a list of strings", "stop")
    extra = {}
    if body.get("speculation") is not None:
        extra["speculation"] = _get(body, "speculation", (bool,))
    fields = dict(max_tokens=max_tokens, temperature=_get(body, "temperature", (int, float), 1.0),
                  top_p=_get(body, "top_p", (int, float), 1.0), top_k=_get(body, "top_k", (int,), 0),
                  seed=_get(body, "seed", (int,)), stop_token_ids=_get(body, "stop_token_ids", (list,), []),
                  ignore_eos=_get(body, "ignore_eos", (bool,), False), stop=stop, **extra)
    if fields["top_k"] == -1:
        fields["top_k"] = 0                           # vLLM's spelling of "off"
    try:
        spec, source, call = structured.parse(body, kind)
    except structured.FieldError as e:
        raise bad(str(e), e.param) from None
    if spec is not None:
        fields["structured_output"] = spec
    try:
        params = SamplingParams(**fields)
    except (ValueError, TypeError) as e:
        param = source if str(e).startswith("structured_output") else _param_named(str(e), fields)
        raise bad(str(e), param) from None
    return body, params, n, call


def _param_named(message: str, fields: dict) -> str | None:
    return next((f for f in fields if message.startswith(f)), None)


def _with_logprobs(params: SamplingParams, logprobs: int | None) -> SamplingParams:
    if logprobs is None:
        return params
    try:
        return SamplingParams(**{**params.__dict__, "logprobs": logprobs})
    except TypeError:
        raise bad("logprobs are not available in this build of specray", "logprobs") from None


def _check_choices(num_prompts: int, n: int, max_choices: int) -> None:
    if num_prompts * n > max_choices:
        raise bad(f"{num_prompts} prompt(s) x n={n} asks for {num_prompts * n} choices; this server takes at most "
                  f"{max_choices} in one request", "n" if n > 1 else "prompt")


def _choices(base: SamplingParams, prompts: list, n: int) -> tuple[list, list[SamplingParams]]:
    out_prompts, out_params = [], []
    for p in prompts:
        for j in range(n):
            seed = None if base.seed is None else (base.seed + j) % 2**63
            out_prompts.append(p)
            out_params.append(base if seed == base.seed else SamplingParams(**{**base.__dict__, "seed": seed}))
    return out_prompts, out_params


def _stream_fields(body: dict) -> tuple[bool, bool]:
    stream = _get(body, "stream", (bool,), False)
    opts = _get(body, "stream_options", (dict,), {})
    include = opts.get("include_usage", False)
    if not isinstance(include, bool):
        raise bad("stream_options.include_usage must be a boolean", "stream_options")
    if opts and not stream:
        raise bad("stream_options is only allowed with stream: true", "stream_options")
    return stream, include


def parse_completion(body: object, served: str, max_model_len: int,
                     max_choices: int = MAX_CHOICES) -> GenerationRequest:
    """``POST /v1/completions``: ``prompt`` a string, a list of strings, a list of token
    ids or a list of such lists."""
    body, base, n = _common(body, "completion", served, max_model_len)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        _check_choices(len(prompt), n, max_choices)         # before walking a list of any length
    if isinstance(prompt, str):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        prompts = [list(prompt)]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        prompts = list(prompt)
    elif isinstance(prompt, list) and prompt and all(isinstance(p, list) and p and all(
            isinstance(t, int) and not isinstance(t, bool) for t in p) for p in prompt):
        prompts = [list(p) for p in prompt]
    else:
        raise bad("prompt must be a string, a list of strings, a list of token ids or a list of token-id lists "
                  "(none empty)", "prompt")
    if any(p == "" for p in prompts):
        raise bad("prompt is empty", "prompt")
    logprobs = _get(body, "logprobs", (int,))
    if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
        raise bad(f"logprobs must be in [0, {MAX_LOGPROBS}], got {logprobs}", "logprobs")
    base = _with_logprobs(base, logprobs)
    stream, include = _stream_fields(body)
    _check_choices(len(prompts), n, max_choices)
    ps, pp = _choices(base, prompts, n)
    return GenerationRequest("completion", served, ps, pp, len(prompts), n, stream, include, logprobs,
                             id=f"cmpl-{uuid.uuid4().hex}")


def chat_messages(messages: object) -> list[dict]:
    """OpenAI's messages as the chat template takes them: content a string, or a list of
    text parts joined."""
    if not isinstance(messages, list) or not messages:
        raise bad("messages must be a non-empty list of {role, content} objects", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise bad(f"messages[{i}] must be an object with role and content", "messages")
        content = m.get("content")
        if isinstance(content, list):
            parts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise bad(f"messages[{i}].content: only text parts ({{'type': 'text', 'text': ...}}) are "
                              "supported", "messages")
                parts.append(part["text"])
            content = "".join(parts)
        elif content is None:
            content = ""
        m = {**m, "content": content}
        try:
            out.append(check_messages([m])[0])
        except ValueError as e:
            raise bad(f"messages[{i}]: {str(e).replace('messages[0] ', '')}", "messages") from None
    return out


def parse_chat(body: object, served: str, max_model_len: int, max_choices: int = MAX_CHOICES) -> GenerationRequest:
    """``POST /v1/chat/completions``."""
    body, base, n, call = _common_with_call(body, "chat", served, max_model_len)
    _check_choices(1, n, max_choices)
    prompt = ChatPrompt(chat_messages(body.get("messages")))
    want = _get(body, "logprobs", (bool,), False)
    top = _get(body, "top_logprobs", (int,))
    if top is not None and not want:
        raise bad("top_logprobs needs logprobs: true", "top_logprobs")
    if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
        raise bad(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {top}", "top_logprobs")
    logprobs = (top or 0) if want else None
    base = _with_logprobs(base, logprobs)
    stream, include = _stream_fields(body)
    if stream and call is not None:
        raise bad("stream is not supported with a tool_choice that constrains the answer to a call", "stream")
    ps, pp = _choices(base, [prompt], n)
    return GenerationRequest("chat", served, ps, pp, 1, n, stream, include, logprobs, tool_call=call,
                             id=f"chatcmpl-{uuid.uuid4().hex}")


# -- responses ---------------------------------------------------------------------

@dataclass
class Choice:
    """What one choice has received so far."""

    index: int
    prompt_tokens: int = 0
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list = field(default_factory=list)        # TokenLogprob entries
    finish_reason: str | None = None
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    def add(self, delta) -> None:
        self.prompt_tokens = len(delta.prompt_token_ids)
        self.token_ids += delta.token_ids
        self.text += delta.text
        self.logprobs += getattr(delta, "logprobs", None) or []
        self.finish_reason = delta.finish_reason
        self.num_draft_tokens = delta.num_draft_tokens
        self.num_accepted_tokens = delta.num_accepted_tokens


def usage(choices: list[Choice], num_prompts: int, n: int) -> dict:
    # Each prompt counts once, however many samples answer it (OpenAI's accounting).
    prompt = sum(c.prompt_tokens for c in choices[::n]) if choices else 0
    completion = sum(len(c.token_ids) for c in choices)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def spec_figures(choices: list[Choice]) -> dict:
    return {"num_draft_tokens": sum(c.num_draft_tokens for c in choices),
            "num_accepted_tokens": sum(c.num_accepted_tokens for c in choices)}


def completion_logprobs(entries: list, names: dict[int, str], offset: int = 0) -> dict:
    """The completions API's log-probabilities: parallel lists, ``text_offset`` counted
    from ``offset`` (the characters of the choice already sent)."""
    tokens = [names[e.token_id] for e in entries]
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t)
    return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{names[i]: lp for i, lp in e.top} for e in entries], "text_offset": offsets}


def chat_logprobs(entries: list, names: dict[int, str]) -> dict:
    def one(tid: int, lp: float) -> dict:
        text = names[tid]
        return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}

    return {"content": [{**one(e.token_id, e.logprob), "top_logprobs": [one(i, lp) for i, lp in e.top]}
                        for e in entries], "refusal": None}


def token_ids_named(entries: list) -> set[int]:
    """The token ids a logprobs answer names (emitted ones and their alternatives)."""
    ids = set()
    for e in entries:
        ids.add(e.token_id)
        ids.update(i for i, _ in e.top)
    return ids


def response(req: GenerationRequest, choices: list[Choice], names: dict[int, str]) -> dict:
    """The whole (non-streamed) response body."""
    body = {"id": req.id, "created": req.created, "model": req.model}
    if req.kind == "completion":
        body["object"] = "text_completion"
        body["choices"] = [{"index": c.index, "text": c.text, "finish_reason": c.finish_reason,
                            "logprobs": completion_logprobs(c.logprobs, names) if req.logprobs is not None
                            else None} for c in choices]
    else:
        body["object"] = "chat.completion"
        body["choices"] = []
        for c in choices:
            msg, finish = {"role": "assistant", "content": c.text}, c.finish_reason
            if req.tool_call is not None:
                msg, finish = tool_calls.message(req.tool_call, c.text, c.finish_reason)
            body["choices"].append({"index": c.index, "message": msg, "finish_reason": finish,
                                    "logprobs": chat_logprobs(c.logprobs, names) if req.logprobs is not None
                                    else None})
    body["usage"] = usage(choices, req.num_prompts, req.n)
    body["specray"] = spec_figures(choices)
    return body


def chunk(req: GenerationRequest, choice: Choice, delta, names: dict[int, str], first: bool,
          sent_chars: int) -> dict:
    """One stream chunk for ``delta`` (a ``RequestOutput`` part) of ``choice`` (which has
    already taken it in); ``sent_chars``: the choice's text sent before it."""
    entries = getattr(delta, "logprobs", None) or []
    body = {"id": req.id, "created": req.created, "model": req.model}
    if req.kind == "completion":
        body["object"] = "text_completion"
        c = {"index": choice.index, "text": delta.text, "finish_reason": delta.finish_reason,
             "logprobs": completion_logprobs(entries, names, sent_chars) if req.logprobs is not None else None}
    else:
        body["object"] = "chat.completion.chunk"
        d = {"role": "assistant", "content": delta.text} if first else {"content": delta.text}
        c = {"index": choice.index, "delta": d, "finish_reason": delta.finish_reason,
             "logprobs": chat_logprobs(entries, names) if req.logprobs is not None else None}
    body["choices"] = [c]
    if delta.finish_reason is not None:
        body["specray"] = spec_figures([choice])
    return body


def usage_chunk(req: GenerationRequest, choices: list[Choice]) -> dict:
    return {"id": req.id, "object": "text_completion" if req.kind == "completion" else "chat.completion.chunk",
            "created": req.created, "model": req.model, "choices": [],
            "usage": usage(choices, req.num_prompts, req.n), "specray": spec_figures(choices)}
