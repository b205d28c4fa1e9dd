"""Tool calls on the chat API: ``tools`` with ``tool_choice`` naming a function, or
``"required"``, constrain the answer to a call (a JSON-schema grammar), and the answer
comes back as OpenAI's ``message.tool_calls`` with ``finish_reason: "tool_calls"``.

- a named function: the answer is its arguments, a JSON value of its ``parameters``;
- ``"required"``: the answer is ``{"name": <one of the tools>, "arguments": {...}}``, the
  arguments of that tool's parameters;
- ``"auto"``, ``"none"`` or no ``tool_choice``: nothing is constrained and the answer is
  text (specray has no model-specific parser that finds calls in free text).

The tools are not shown to the model by the chat template here: the grammar alone makes
the call. Streaming a constrained tool call is refused (``stream``): its arguments are
told whole, when the answer is complete.
"""

from __future__ import annotations

import json
import uuid

_EMPTY = {"type": "object", "properties": {}}


def parse(body: dict, kind: str) -> dict | None:
    """The call a body asks for: ``{"schema", "name"}`` (``name`` None for "required"),
    or None when no call is asked for. Raises ``structured.FieldError``."""
    from specray.runtime.entrypoints.openai.structured import FieldError

    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools is None:
        if choice not in (None, "none"):
            raise FieldError("tool_choice needs tools", "tool_choice")
        return None
    if kind != "chat":
        raise FieldError("tools are a chat completions field", "tools")
    if not isinstance(tools, list) or not tools:
        raise FieldError("tools must be a non-empty list of {type: function, function: {name, parameters}}", "tools")
    params = {}
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict):
            raise FieldError(f"tools[{i}] must be {{type: function, function: {{name, parameters}}}}", "tools")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise FieldError(f"tools[{i}].function.name must be a non-empty string", "tools")
        if name in params:
            raise FieldError(f"tools name the function {name!r} twice", "tools")
        p = fn.get("parameters", _EMPTY)
        if not isinstance(p, dict):
            raise FieldError(f"tools[{i}].function.parameters must be a JSON schema (an object)", "tools")
        params[name] = p
    if choice in (None, "auto", "none"):
        return None
    if choice == "required":
        return {"name": None, "schema": {"anyOf": [
            {"type": "object", "properties": {"name": {"const": n}, "arguments": p},
             "required": ["name", "arguments"], "additionalProperties": False} for n, p in params.items()]}}
    fn = choice.get("function") if isinstance(choice, dict) else None
    if not (isinstance(choice, dict) and choice.get("type") == "function" and isinstance(fn, dict)
            and isinstance(fn.get("name"), str)):
        raise FieldError("tool_choice must be 'none', 'auto', 'required' or {type: function, function: {name}}",
                         "tool_choice")
    if fn["name"] not in params:
        raise FieldError(f"tool_choice names {fn['name']!r}, which is not among the tools", "tool_choice")
    return {"name": fn["name"], "schema": params[fn["name"]]}


def message(call: dict, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
    """The chat answer's message and finish reason for a constrained call whose output
    is ``text``: the call in ``tool_calls`` when the grammar completed ("stop"), else (cut
    off by max_tokens or a stop string) the text as content, as it came."""
    try:
        answer = json.loads(text) if finish_reason == "stop" else None
    except ValueError:
        answer = None           # a stop string cut it short
    if answer is None:
        return {"role": "assistant", "content": text}, finish_reason
    if call["name"] is not None:
        name, arguments = call["name"], text
    else:
        name, arguments = answer["name"], json.dumps(answer["arguments"])
    return {"role": "assistant", "content": None, "tool_calls": [
        {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
         "function": {"name": name, "arguments": arguments}}]}, "tool_calls"
