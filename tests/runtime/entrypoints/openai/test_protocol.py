"""OpenAI bodies as specray requests, and responses back: fields mapped, defaults as
OpenAI's, choices numbered prompt by sample with seeds seed + j, bad fields refused
naming them."""

from __future__ import annotations

import pytest

from specray.runtime.chat import ChatPrompt
from specray.runtime.entrypoints.openai import protocol as api
from specray.runtime.request_output import RequestOutput


def completion(**body):
    return api.parse_completion({"model": "m", **body}, "m", 128)


def test_completion_fields_map_onto_sampling_params():
    r = completion(prompt="hi", max_tokens=7, temperature=0.5, top_p=0.9, seed=3, stop="\n",
                   top_k=5, ignore_eos=True, stop_token_ids=[4])
    (p,) = r.params
    assert (p.max_tokens, p.temperature, p.top_p, p.seed, p.stop, p.top_k, p.ignore_eos, p.stop_token_ids) == \
        (7, 0.5, 0.9, 3, ["\n"], 5, True, [4])
    assert r.prompts == ["hi"] and not r.stream


def test_defaults_are_openais():
    (p,) = completion(prompt="hi").params
    assert (p.max_tokens, p.temperature, p.top_p) == (16, 1.0, 1.0)
    chat = api.parse_chat({"model": "m", "messages": [{"role": "user", "content": "x"}]}, "m", 128)
    assert chat.params[0].max_tokens == 128                 # chat runs to the end of the window
    assert chat.prompts == [ChatPrompt([{"role": "user", "content": "x"}])]
    chat = api.parse_chat({"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 5,
                           "max_completion_tokens": 9}, "m", 128)
    assert chat.params[0].max_tokens == 9


def test_choices_run_prompt_by_sample_with_seeds_counting_up():
    r = completion(prompt=["a", "b"], n=3, seed=10)
    assert r.prompts == ["a"] * 3 + ["b"] * 3
    assert [p.seed for p in r.params] == [10, 11, 12] * 2
    assert [p.seed for p in completion(prompt=[[1, 2], [3]], n=2).params] == [None] * 4
    assert completion(prompt=[1, 2, 3]).prompts == [[1, 2, 3]]


@pytest.mark.parametrize("body, param", [
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": "x", "max_tokens": True}, "max_tokens"),
    ({"prompt": "x", "temperature": "hot"}, "temperature"),
    ({"prompt": "x", "logprobs": 6}, "logprobs"),
    ({"prompt": "x", "stop": [1]}, "stop"),
    ({"prompt": [[]]}, "prompt"),
    ({"prompt": [1, "a"]}, "prompt"),
    ({"prompt": "x", "frequency_penalty": 1}, "frequency_penalty"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": "x", "speculation": "no"}, "speculation"),
    ({"prompt": "x", "cache_salt": 7}, "cache_salt"),
    ({"prompt": "x", "cache_salt": ""}, "cache_salt"),
])
def test_bad_fields_are_refused_naming_them(body, param):
    with pytest.raises(api.ApiError) as e:
        completion(**body)
    assert (e.value.status, e.value.param) == (400, param)


def test_unknown_model_is_404_and_neutral_fields_pass():
    with pytest.raises(api.ApiError) as e:
        api.parse_completion({"model": "other", "prompt": "x"}, "m", 128)
    assert e.value.status == 404 and e.value.body()["error"]["code"] == "model_not_found"
    completion(prompt="x", presence_penalty=0, frequency_penalty=0.0, user="u", echo=False)


def test_chat_content_parts_join_and_others_are_refused():
    r = api.parse_chat({"model": "m", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]}, "m", 64)
    assert r.prompts[0].messages == [{"role": "user", "content": "ab"}]
    with pytest.raises(api.ApiError, match="only text parts"):
        api.parse_chat({"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "m", 64)
    with pytest.raises(api.ApiError, match="top_logprobs needs logprobs"):
        api.parse_chat({"model": "m", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "m", 64)


def test_responses_carry_usage_once_per_prompt_and_specrays_figures():
    r = completion(prompt=["a", "b"], n=2)
    choices = []
    for i, (text, ntok) in enumerate([("x", 2), ("yy", 3), ("z", 1), ("w", 4)]):
        c = api.Choice(i)
        c.add(RequestOutput(str(i), [1] * (3 if i < 2 else 5), list(range(ntok)), text, "length", 4, 2,
                            num_cached_tokens=[0, 0, 4, 4][i]))
        choices.append(c)
    body = api.response(r, choices, {})
    assert body["object"] == "text_completion"
    assert [c["text"] for c in body["choices"]] == ["x", "yy", "z", "w"]
    # cached prompt tokens count once per prompt, as prompt_tokens do
    assert body["usage"] == {"prompt_tokens": 8, "completion_tokens": 10, "total_tokens": 18,
                             "prompt_tokens_details": {"cached_tokens": 4}}
    assert body["specray"] == {"num_draft_tokens": 16, "num_accepted_tokens": 8}


@pytest.mark.parametrize("body, param", [
    ({"prompt": ["a", "b", "c"], "n": 3}, "n"),
    ({"prompt": ["a"] * 9}, "prompt"),
    ({"prompt": [[1]] * 9}, "prompt"),
    ({"prompt": "a", "n": 9}, "n"),
])
def test_more_choices_than_the_bound_are_refused_before_any_is_built(body, param):
    with pytest.raises(api.ApiError) as e:
        api.parse_completion({"model": "m", **body}, "m", 128, max_choices=8)
    assert (e.value.status, e.value.param) == (400, param) and "at most 8" in e.value.message
    assert len(api.parse_completion({"model": "m", "prompt": ["a", "b"], "n": 4}, "m", 128, max_choices=8).params) == 8
    assert len(api.parse_completion({"model": "m", "prompt": [1, 2, 3] * 5}, "m", 128, max_choices=8).prompts) == 1
    with pytest.raises(api.ApiError) as e:
        api.parse_chat({"model": "m", "messages": [{"role": "user", "content": "x"}], "n": 9}, "m", 64, max_choices=8)
    assert e.value.param == "n"


def test_client_errors_are_invalid_request_errors_and_server_ones_server_errors():
    assert [api.ApiError(s, "m").type for s in (400, 401, 404, 413, 415, 429, 500, 503)] == [
        "invalid_request_error", "invalid_request_error", "not_found_error", "invalid_request_error",
        "invalid_request_error", "rate_limit_error", "server_error", "service_unavailable"]


def test_cache_salt_reaches_sampling_params():
    assert completion(prompt="x", cache_salt="tenant-a").params[0].cache_salt == "tenant-a"
    assert completion(prompt="x").params[0].cache_salt is None
