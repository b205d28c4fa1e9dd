"""Per-request sampling parameters, validated on construction."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from specray.scheduler.structured_output import StructuredOutput

GREEDY_BELOW = 1e-5
# Past this, dividing float32 logits by the temperature flattens every gap a model makes
# to nothing (and near float32's range it is inf, and -inf / inf is NaN): the bound keeps
# the worker's arithmetic finite.
MAX_TEMPERATURE = 1e4
MAX_STOP_STRINGS = 8
MAX_STOP_CHARS = 256  # each stop string's length: they are searched on every step's text
MAX_LOGPROBS = 20     # top alternatives a request may ask for per token (the OpenAI API's bound)
# What a step packs its integers into (``specray.scheduler.messages``: top_k, counts and
# token ids travel as int32): a larger value must be refused here, not fail a step.
INT32_MAX = 2**31 - 1


@dataclass
class SamplingParams:
    """How one request is decoded.

    temperature 0 means greedy, and so does any temperature below ``GREEDY_BELOW`` (as in
    vLLM): dividing logits by it would overflow float32 and sample garbage or NaN; at most
    ``MAX_TEMPERATURE``. ``top_k == 0`` and ``top_p == 1`` switch those filters off; a
    ``top_k`` at or past the vocabulary is off too (the driver clears it).
    ``max_tokens``, ``top_k`` and ``stop_token_ids`` are at most ``INT32_MAX``; a request is
    served up to the model's window whatever its ``max_tokens`` (it then ends with
    "length").
    ``seed`` makes a sampled request reproducible whatever batch it shares; requests without
    one get a seed drawn from the runtime's own generator.
    ``stop``: strings (at most ``MAX_STOP_STRINGS``, of at most ``MAX_STOP_CHARS`` each)
    that end the output where they first appear in its text; the matched string is not
    returned, and tokens past the one that completed it are dropped.
    ``logprobs``: None for none; n in [0, ``MAX_LOGPROBS``] for each emitted token's
    logprob under the target's raw logits (before temperature, top-k and top-p) and its n
    most likely alternatives. ``speculation=False`` decodes the request plainly: nothing
    is proposed for it, whatever the runtime's proposer.
    ``structured_output``: None, or what the output must match (a ``StructuredOutput``, or a
    dict with one of its kinds: ``json``, ``json_object``, ``regex``, ``choice``,
    ``grammar``); the output is then sampled from the target's distribution restricted to
    the tokens the grammar allows, with or without speculation, and ends ("stop") where the
    grammar is complete. It cannot be combined with ``ignore_eos``.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    stop: list[str] = field(default_factory=list)
    logprobs: int | None = None
    speculation: bool = True
    structured_output: StructuredOutput | None = None

    def __post_init__(self) -> None:
        _check_int("max_tokens", self.max_tokens)
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {_shown(self.max_tokens)}")
        if self.max_tokens > INT32_MAX:
            raise ValueError(f"max_tokens must be at most {INT32_MAX}, got {_shown(self.max_tokens)}")
        self.temperature = _finite("temperature", self.temperature)
        if not 0.0 <= self.temperature <= MAX_TEMPERATURE:
            raise ValueError(f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {self.temperature}")
        if self.temperature < GREEDY_BELOW:
            self.temperature = 0.0
        self.top_p = _finite("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        _check_int("top_k", self.top_k)
        if not 0 <= self.top_k <= INT32_MAX:
            raise ValueError(f"top_k must be in [0, {INT32_MAX}] (0 = off), got {_shown(self.top_k)}")
        if self.seed is not None:
            _check_int("seed", self.seed)
            if not 0 <= self.seed < 2**63:
                raise ValueError(f"seed must be in [0, 2**63), got {_shown(self.seed)}")
        if not isinstance(self.stop_token_ids, (list, tuple)):
            raise ValueError(f"stop_token_ids must be a list of ints, got {type(self.stop_token_ids).__name__}")
        for t in self.stop_token_ids:
            _check_int("stop_token_ids", t)
            if not 0 <= t <= INT32_MAX:
                raise ValueError(f"stop_token_ids entries must be in [0, {INT32_MAX}], got {_shown(t)}")
        self.stop_token_ids = list(self.stop_token_ids)
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {type(self.ignore_eos).__name__}")
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs)
            if not 0 <= self.logprobs <= MAX_LOGPROBS:
                raise ValueError(f"logprobs must be None or in [0, {MAX_LOGPROBS}], got {_shown(self.logprobs)}")
        if not isinstance(self.speculation, bool):
            raise ValueError(f"speculation must be a bool, got {type(self.speculation).__name__}")

        if self.structured_output is not None:
            self.structured_output = StructuredOutput.from_value(self.structured_output)
            if self.ignore_eos:
                raise ValueError("structured_output ends the output where the grammar is complete; "
                                 "it cannot be combined with ignore_eos")

        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop, (list, tuple)):
            raise ValueError(f"stop must be a string or a list of strings, got {type(self.stop).__name__}")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop has {len(self.stop)} strings; at most {MAX_STOP_STRINGS}")
        for x in self.stop:
            if not isinstance(x, str) or not x:
                raise ValueError(f"stop entries must be non-empty strings, got {_shown(x)}")
            if len(x) > MAX_STOP_CHARS:
                raise ValueError(f"stop entries must be at most {MAX_STOP_CHARS} characters, got one of {len(x)}")
        self.stop = list(self.stop)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @classmethod
    def from_dict(cls, d: dict) -> "SamplingParams":
        unknown = set(d) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown sampling field(s): {sorted(unknown)}")
        return cls(**d)


def _check_int(name: str, value: object) -> None:
    # bool is an int subclass; True as max_tokens is a bug, not a request.
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {type(value).__name__}")


def _finite(name: str, value: object) -> float:
    """``value`` as a finite float. A JSON integer of 400 digits is an int that float()
    cannot hold: refused here, naming the field, not as an OverflowError in a step."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {type(value).__name__}")
    try:
        x = float(value)
    except OverflowError:
        x = math.inf
    if not math.isfinite(x):
        raise ValueError(f"{name} must be a finite number, got {_shown(value)}")
    return x


def _shown(value: object) -> str:
    """A refused value as an error message quotes it: huge ones are cut short (a 100k-digit
    int's repr alone costs more than the check, and echoes the request back)."""
    if isinstance(value, int) and abs(value) >= 2**64:
        return f"an int of {value.bit_length()} bits"      # str() of a huge int may itself refuse
    text = repr(value)
    return text if len(text) <= 64 else text[:61] + "..."
