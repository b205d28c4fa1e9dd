"""What a request's output must match: ``SamplingParams.structured_output``.

Exactly one of five kinds, as vLLM's ``structured_outputs`` names them:

- ``json``: a JSON schema (a dict, or its JSON text); the answer is one JSON value it accepts;
- ``json_object``: ``True``; the answer is any JSON object (OpenAI's "JSON mode");
- ``regex``: the answer matches the regular expression whole (Rust ``regex`` syntax);
- ``choice``: a list of strings; the answer is one of them;
- ``grammar``: a context-free grammar in Lark syntax (llguidance's dialect; GBNF is taken too).

The grammar is checked here, where the request is built, by llguidance (the engine the
workers mask with; ``docs/structured-output.md`` says why that one): an invalid schema,
regex or grammar, or a schema feature llguidance does not implement, is a ``ValueError``
whose message begins ``structured_output.<kind>`` and says what is wrong. Checking needs no
tokenizer; the driver checks once more against the target's (``workers.grammar``).

A spec travels to the workers as ``key``: compact JSON text of ``{kind: value}``, keys in
their given order (a JSON schema's properties are written in the order it lists them);
workers cache their compiled grammars by it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

KINDS = ("json", "json_object", "regex", "choice", "grammar")
MAX_SPEC_CHARS = 64 * 1024      # a spec's canonical text: it rides in every step's plan
MAX_CHOICES = 1024
# JSON is written with one space after ':' and ',' and no other whitespace (a schema's own
# "x-guidance" options may say otherwise): free whitespace lets a model pad an answer with
# newlines and spaces until max_tokens, which small models do.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class StructuredOutput:
    """One of ``json``, ``json_object``, ``regex``, ``choice``, ``grammar`` (see the module)."""

    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured_output needs exactly one of {', '.join(KINDS)}; got "
                             f"{', '.join(given) if given else 'none'}")
        kind = given[0]
        value = getattr(self, kind)
        if kind == "json":
            if isinstance(value, str):
                try:
                    value = json.loads(value)
                except ValueError as e:
                    raise ValueError(f"structured_output.json is not valid JSON: {e}") from None
            if not isinstance(value, (dict, bool)):
                raise ValueError(f"structured_output.json must be a JSON schema (an object), got "
                                 f"{type(value).__name__}")
            object.__setattr__(self, "json", value)
        elif kind == "json_object":
            if value is not True:
                raise ValueError(f"structured_output.json_object must be true, got {value!r}")
        elif kind in ("regex", "grammar"):
            if not isinstance(value, str) or not value:
                raise ValueError(f"structured_output.{kind} must be a non-empty string")
        else:
            if not isinstance(value, (list, tuple)) or not value:
                raise ValueError("structured_output.choice must be a non-empty list of strings")
            if len(value) > MAX_CHOICES:
                raise ValueError(f"structured_output.choice has {len(value)} strings; at most {MAX_CHOICES}")
            if not all(isinstance(x, str) and x for x in value):
                raise ValueError("structured_output.choice entries must be non-empty strings")
            object.__setattr__(self, "choice", list(value))
        # Keys keep their order: a schema's property order is the order the answer writes them in.
        try:
            key = json.dumps({kind: getattr(self, kind)}, separators=(",", ":"), ensure_ascii=False)
        except (TypeError, ValueError, RecursionError) as e:     # not JSON, or nested past the stack
            raise ValueError(f"structured_output.{kind} is not JSON-serialisable: {type(e).__name__}") from None
        if len(key) > MAX_SPEC_CHARS:
            raise ValueError(f"structured_output.{kind} is {len(key)} characters; at most {MAX_SPEC_CHARS}")
        object.__setattr__(self, "_key", key)     # not a field: asdict() gives the five kinds only
        check_grammar(self)

    @property
    def key(self) -> str:
        return self._key

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @classmethod
    def from_value(cls, value: object) -> StructuredOutput:
        """A ``StructuredOutput``, or a dict with one of its kinds (vLLM's
        ``structured_outputs`` object); other keys are refused, naming them."""
        if isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"structured_output must be a dict with one of {', '.join(KINDS)}, got "
                             f"{type(value).__name__}")
        unknown = sorted(set(value) - set(KINDS))
        if unknown:
            raise ValueError(f"structured_output has unknown key(s) {unknown}; it takes one of {', '.join(KINDS)}")
        return cls(**value)

    @classmethod
    def from_key(cls, key: str) -> StructuredOutput:
        return cls(**json.loads(key))


def grammar_text(spec: StructuredOutput) -> str:
    """The spec as an llguidance grammar (its JSON form), before any tokenizer is known."""
    import llguidance  # a compiled extension without dependencies: no torch here

    kind, value = spec.kind, getattr(spec, spec.kind)
    try:
        if kind == "json":
            return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(value), defaults=JSON_LAYOUT)
        if kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=JSON_LAYOUT)
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(value)
        if kind == "choice":
            return llguidance.grammar_from("choice", json.dumps(value))
        return llguidance.grammar_from("grammar", value)
    except ValueError as e:
        raise ValueError(f"structured_output.{kind}: {e}") from None


def check_grammar(spec: StructuredOutput, tokenizer=None) -> str:
    """The spec's grammar text, refused with a ``ValueError`` naming ``structured_output.<kind>``
    where llguidance finds it invalid or unsupported (its message says which feature).
    ``tokenizer``: an ``llguidance.LLTokenizer`` to check against, or None."""
    import llguidance

    text = grammar_text(spec)
    failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(text, tokenizer)
    if failed:
        raise ValueError(f"structured_output.{spec.kind}: {'; '.join(m.strip() for m in messages)[:500]}")
    return text
