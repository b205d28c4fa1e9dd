"""Structured output on the OpenAI API: the request fields that constrain an answer,
turned into one ``StructuredOutput`` (``parse``), and the name of the field a refusal is
about (every 400 names the field the client wrote: ``response_format``,
``structured_outputs``, ``tools`` or ``tool_choice``).

- ``response_format``: ``{"type": "text"}`` (no constraint), ``{"type": "json_object"}``,
  or ``{"type": "json_schema", "json_schema": {"name", "schema", "strict"?, "description"?}}``;
- ``structured_outputs`` (vLLM's extra field): ``{json | json_object | regex | choice | grammar}``;
- ``tools`` with ``tool_choice`` naming a function, or ``"required"``: the answer is a call
  of that function (its ``parameters`` schema), or of one of the tools
  (``specray.runtime.entrypoints.openai.tool_calls``).
"""

from __future__ import annotations

import re

from specray.scheduler.structured_output import StructuredOutput

_SCHEMA_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


class FieldError(ValueError):
    """Bad input in one request field, named by ``param``."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def parse(body: dict, kind: str) -> tuple[StructuredOutput | None, str | None, dict | None]:
    """The constraint a request body asks for, the field it came from, and, when it is a
    tool call, the call's shape (``tool_calls.ToolCallShape``'s dict). None, None, None
    when it asks for none. Raises ``FieldError`` naming the field."""
    from specray.runtime.entrypoints.openai import tool_calls

    asked = [name for name in ("response_format", "structured_outputs") if body.get(name) is not None]
    call = tool_calls.parse(body, kind)
    if call is not None:
        asked.append("tools")
    if len(asked) > 1:
        raise FieldError(f"{' and '.join(asked)} each constrain the answer; send one of them", asked[1])
    if not asked:
        return None, None, None
    field = asked[0]
    try:
        if field == "tools":
            return StructuredOutput(json=call["schema"]), "tools", call
        if field == "structured_outputs":
            return StructuredOutput.from_value(body[field]), field, None
        return _response_format(body[field]), field, None
    except ValueError as e:
        if isinstance(e, FieldError):
            raise
        raise FieldError(f"{field}: {e}", field) from None


def _response_format(rf: object) -> StructuredOutput | None:
    if not isinstance(rf, dict):
        raise FieldError("response_format must be an object with a type", "response_format")
    kind = rf.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput(json_object=True)
    if kind != "json_schema":
        raise FieldError(f"response_format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
                         "response_format")
    js = rf.get("json_schema")
    if not isinstance(js, dict):
        raise FieldError("response_format.json_schema must be an object with name and schema", "response_format")
    name = js.get("name")
    if not isinstance(name, str) or not _SCHEMA_NAME.fullmatch(name):
        raise FieldError("response_format.json_schema.name must be 1 to 64 characters of a-z, A-Z, 0-9, _ and -",
                         "response_format")
    if "strict" in js and js["strict"] is not None and not isinstance(js["strict"], bool):
        raise FieldError("response_format.json_schema.strict must be a boolean", "response_format")
    schema = js.get("schema")
    if not isinstance(schema, dict):
        raise FieldError("response_format.json_schema.schema must be a JSON schema (an object)", "response_format")
    # strict or not, the answer follows the schema: llguidance enforces what it implements
    # and refuses the rest (naming the keyword), never ignores it.
    return StructuredOutput(json=schema)
