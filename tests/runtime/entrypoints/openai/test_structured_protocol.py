"""The OpenAI request fields that constrain an answer, without a server: response_format,
vLLM's structured_outputs, tools with tool_choice; every refusal a 400 naming the field
the client wrote; a constrained call answered as OpenAI's tool_calls."""

from __future__ import annotations

import json

import pytest

from specray.runtime.entrypoints.openai import protocol as api
from specray.runtime.entrypoints.openai import tool_calls
from specray.scheduler.structured_output import StructuredOutput

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}},
         {"type": "function", "function": {"name": "now"}}]


def chat(**kw):
    return api.parse_chat({"model": "m", "messages": [{"role": "user", "content": "hi"}], **kw}, "m", 64)


def spec_of(req) -> StructuredOutput | None:
    return req.params[0].structured_output


@pytest.mark.parametrize("kw, want", [
    ({}, None),
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": {"type": "json_object"}}, StructuredOutput(json_object=True)),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "w-1", "schema": SCHEMA, "strict": True}}},
     StructuredOutput(json=SCHEMA)),
    ({"structured_outputs": {"regex": "[a-z]+"}}, StructuredOutput(regex="[a-z]+")),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, StructuredOutput(choice=["yes", "no"])),
    ({"structured_outputs": {"grammar": 'start: "a"+'}}, StructuredOutput(grammar='start: "a"+')),
    ({"tools": TOOLS}, None),
    ({"tools": TOOLS, "tool_choice": "auto"}, None),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
     StructuredOutput(json=SCHEMA)),
])
def test_fields_become_one_structured_output(kw, want):
    req = chat(**kw)
    assert spec_of(req) == want
    assert all(p.structured_output == want for p in req.params)


def test_completions_take_response_format_and_structured_outputs_too():
    req = api.parse_completion({"model": "m", "prompt": "x", "structured_outputs": {"json_object": True}}, "m", 64)
    assert spec_of(req) == StructuredOutput(json_object=True)


def test_required_tool_choice_is_a_call_of_any_tool():
    req = chat(tools=TOOLS, tool_choice="required")
    schema = spec_of(req).json
    assert [a["properties"]["name"]["const"] for a in schema["anyOf"]] == ["get_weather", "now"]
    assert schema["anyOf"][0]["properties"]["arguments"] == SCHEMA
    assert req.tool_call["name"] is None


@pytest.mark.parametrize("kw, param, match", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": {"type": "strnig"}}}},
     "response_format", "strnig"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": {"if": {}, "then": {}}}}},
     "response_format", r'Unimplemented keys: \["if", "then"\]'),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "bad name", "schema": SCHEMA}}},
     "response_format", "name must be"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "w"}}}, "response_format", "schema"),
    ({"response_format": {"type": "xml"}}, "response_format", "type must be"),
    ({"response_format": "json"}, "response_format", "an object"),
    ({"structured_outputs": {"regex": "("}}, "structured_outputs", "regex"),
    ({"structured_outputs": {"ebnf": "x"}}, "structured_outputs", "unknown key"),
    ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}}, "structured_outputs",
     "send one of them"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": [{"type": "function"}], "tool_choice": "required"}, "tools", r"tools\[0\]"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "not among the tools"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "must be"),
    ({"tools": TOOLS, "tool_choice": "required", "stream": True}, "stream", "stream is not supported"),
    ({"structured_outputs": {"regex": "a"}, "ignore_eos": True}, "structured_outputs", "ignore_eos"),
])
def test_refusals_are_400s_naming_the_field(kw, param, match):
    with pytest.raises(api.ApiError) as e:
        chat(**kw)
    assert e.value.status == 400 and e.value.param == param
    assert __import__("re").search(match, e.value.message), e.value.message


def test_tools_on_completions_are_refused_naming_them():
    with pytest.raises(api.ApiError) as e:
        api.parse_completion({"model": "m", "prompt": "x", "tools": TOOLS, "tool_choice": "required"}, "m", 64)
    assert e.value.param == "tools"


def test_a_finished_call_is_answered_as_tool_calls():
    named = {"name": "get_weather", "schema": SCHEMA}
    msg, finish = tool_calls.message(named, '{"city": "Oslo"}', "stop")
    assert finish == "tool_calls" and msg["content"] is None
    (call,) = msg["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    msg, finish = tool_calls.message({"name": None, "schema": {}},
                                     '{"name": "now", "arguments": {}}', "stop")
    assert finish == "tool_calls" and msg["tool_calls"][0]["function"] == {"name": "now", "arguments": "{}"}
    # Cut off by max_tokens (or a stop string): the text as it came, with its own reason.
    assert tool_calls.message(named, '{"city": "Os', "length") == ({"role": "assistant", "content": '{"city": "Os'},
                                                                   "length")
    assert tool_calls.message(named, '{"city"', "stop")[1] == "stop"


def test_the_response_body_carries_the_call():
    req = chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    c = api.Choice(0, prompt_tokens=3, token_ids=[1, 2], text=json.dumps({"city": "Rome"}), finish_reason="stop")
    body = api.response(req, [c], {})
    (choice,) = body["choices"]
    assert choice["finish_reason"] == "tool_calls"
    assert json.loads(choice["message"]["tool_calls"][0]["function"]["arguments"]) == {"city": "Rome"}
