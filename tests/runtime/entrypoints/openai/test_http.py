"""The OpenAI-compatible endpoint, through a real server on 127.0.0.1 (Ray Serve, the
built-in model pair) and the official ``openai`` client: outputs equal transformers'
greedy generate on the same tokens, streams equal whole responses, stop strings, seeded
samples, errors in OpenAI's body with the server serving on, many streams at once, and a
dropped stream's blocks freed."""

from __future__ import annotations

import asyncio
import json
import shutil
import time
import urllib.request

import pytest
from specray_testing import free_port, hf_greedy

from specray import RuntimeConfig, SamplingParams, SpecRuntime
from specray.runtime.model_store import builtin_model

openai = pytest.importorskip("openai")

DRIVER = "specray-http-test"
NAMESPACE = "specray-http-test"
MODEL = "tiny"
TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")
PROMPTS = ["def parse_args(", "import os\nimport sys\n", "class Config:\n    def __init__(self"]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """The built-in pair, its target's tokenizer given a chat template."""
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("http")
    t, d = str(root / "tiny-target"), str(root / "tiny-draft")
    shutil.copytree(builtin_model("tiny-target"), t)
    shutil.copytree(builtin_model("tiny-draft"), d)
    tok = AutoTokenizer.from_pretrained(t)
    tok.chat_template = TEMPLATE
    tok.save_pretrained(t)
    return t, d, AutoTokenizer.from_pretrained(t)


@pytest.fixture(scope="module")
def server(ray_module, pair):
    from specray.runtime.entrypoints.openai.ingress import start_http, stop_http

    t, d, _ = pair
    rt = SpecRuntime(RuntimeConfig(target=t, draft=d, num_speculative_tokens=4, device="cpu", dtype="float32",
                                   max_model_len=256, name=DRIVER, namespace=NAMESPACE, max_pending=64))
    try:
        url = start_http(DRIVER, NAMESPACE, MODEL, port=free_port())
        yield url, rt
    finally:
        try:
            stop_http()
        finally:
            rt.shutdown()


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0, timeout=120)


def ids_of(tok, text: str) -> list[int]:
    from specray.workers.model_loader import encode_prompt

    return encode_prompt(tok, text)


def test_greedy_completions_equal_transformers_generate_with_exact_usage(client, pair):
    t, _, tok = pair
    r = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=24, temperature=0,
                                  extra_body={"ignore_eos": True})
    ids = [ids_of(tok, p) for p in PROMPTS]
    want = hf_greedy(t, ids, 24)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.text for c in r.choices] == [tok.decode(w, skip_special_tokens=True) for w in want]
    assert all(c.finish_reason == "length" for c in r.choices)
    assert r.usage.prompt_tokens == sum(map(len, ids))
    assert r.usage.completion_tokens == 3 * 24
    assert r.usage.total_tokens == r.usage.prompt_tokens + 72
    figures = r.model_extra["specray"]
    assert figures["num_draft_tokens"] > 0 and 0 <= figures["num_accepted_tokens"] <= figures["num_draft_tokens"]
    # A prompt of token ids is served as those ids.
    r2 = client.completions.create(model=MODEL, prompt=ids[0], max_tokens=24, temperature=0,
                                   extra_body={"ignore_eos": True})
    assert r2.choices[0].text == r.choices[0].text


def test_greedy_chat_equals_transformers_generate_on_the_templated_ids(client, pair):
    t, _, tok = pair
    messages = [{"role": "user", "content": "def add(a, b):"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0,
                                       extra_body={"ignore_eos": True})
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    want = hf_greedy(t, [ids], 20)[0]
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == tok.decode(want, skip_special_tokens=True)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), 20)
    # Content given as text parts is the same conversation.
    parts = [{"role": "user", "content": [{"type": "text", "text": "def add("}, {"type": "text", "text": "a, b):"}]}]
    r2 = client.chat.completions.create(model=MODEL, messages=parts, max_tokens=20, temperature=0,
                                        extra_body={"ignore_eos": True})
    assert r2.choices[0].message.content == r.choices[0].message.content


def _join(stream) -> tuple[list[str], list, list]:
    texts, finishes, chunks = {}, {}, list(stream)
    for ch in chunks:
        for c in ch.choices:
            piece = c.text if hasattr(c, "text") else (c.delta.content or "")
            texts[c.index] = texts.get(c.index, "") + piece
            if c.finish_reason is not None:
                finishes.setdefault(c.index, []).append(c.finish_reason)
    return [texts[i] for i in sorted(texts)], [finishes[i] for i in sorted(finishes)], chunks


def test_a_stream_joined_equals_the_whole_response(client):
    kw = dict(model=MODEL, max_tokens=30, temperature=0.8, seed=11, n=2)
    whole = client.completions.create(prompt=PROMPTS[:2], **kw)
    texts, finishes, chunks = _join(client.completions.create(prompt=PROMPTS[:2], stream=True,
                                                              stream_options={"include_usage": True}, **kw))
    assert texts == [c.text for c in whole.choices]
    assert finishes == [[c.finish_reason] for c in whole.choices]      # exactly one per choice
    # The counts agree; the stream's prompts may be served from the prefix cache the whole
    # answer filled (prompt_tokens_details.cached_tokens).
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")
    assert chunks[-1].choices == [] and [getattr(chunks[-1].usage, c) for c in counts] == \
        [getattr(whole.usage, c) for c in counts]

    chat_kw = dict(model=MODEL, messages=[{"role": "user", "content": "for i in"}], max_tokens=25, temperature=0)
    whole = client.chat.completions.create(**chat_kw)
    stream = list(client.chat.completions.create(stream=True, **chat_kw))
    assert stream[0].choices[0].delta.role == "assistant"
    assert all(ch.choices[0].delta.role is None for ch in stream[1:])
    texts, finishes, _ = _join(stream)
    assert texts == [whole.choices[0].message.content] and finishes == [[whole.choices[0].finish_reason]]
    assert stream[-1].usage is None                               # no usage chunk unless asked


def test_stop_strings_end_the_text_before_them_with_the_fewest_tokens(client, pair):
    t, _, tok = pair
    prompt = PROMPTS[1]
    ids = ids_of(tok, prompt)
    full = hf_greedy(t, [ids], 40)[0]
    text = tok.decode(full, skip_special_tokens=True)
    stop = text[6:8]                                  # a string the greedy output holds
    cut = text.index(stop)
    need = next(n for n in range(1, 41) if stop in tok.decode(full[:n], skip_special_tokens=True))
    for stream in (False, True):
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=0,
                                      stop=["never appears", stop], stream=stream,
                                      stream_options={"include_usage": True} if stream else None,
                                      extra_body={"ignore_eos": True})
        if stream:
            texts, finishes, chunks = _join(r)
            assert texts == [text[:cut]] and finishes == [["stop"]]
            usage = chunks[-1].usage
        else:
            assert (r.choices[0].text, r.choices[0].finish_reason) == (text[:cut], "stop")
            usage = r.usage
        assert usage.completion_tokens == need


def test_n_samples_with_a_seed_are_reproducible_and_distinct(client):
    kw = dict(model=MODEL, prompt=PROMPTS[0], max_tokens=24, temperature=1.0, n=3, seed=1234)
    a = [c.text for c in client.completions.create(**kw).choices]
    b = [c.text for c in client.completions.create(**kw).choices]
    assert a == b
    assert len(set(a)) == 3
    other = [c.text for c in client.completions.create(**{**kw, "seed": 99}).choices]
    assert other != a


@pytest.mark.parametrize("kw, param", [
    ({"max_tokens": 0}, "max_tokens"),
    ({"temperature": -1}, "temperature"),
    ({"top_p": 1.5}, "top_p"),
    ({"n": 0}, "n"),
    ({"logprobs": 9}, "logprobs"),
    ({"stop": ["a"] * 9}, "stop"),
    ({"prompt": ""}, "prompt"),
    ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"extra_body": {"top_k": "three"}}, "top_k"),
    ({"prompt": [5, 99999]}, "prompt"),
])
def test_bad_fields_are_400s_naming_them_and_the_server_serves_on(client, kw, param):
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 4, **kw}
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(**body)
    assert e.value.status_code == 400
    assert e.value.body["param"] == param and e.value.body["type"] == "invalid_request_error"
    assert e.value.body["message"]
    assert client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=4).choices[0].finish_reason


def test_unknown_model_is_404_and_bad_json_400(client, server):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-4", prompt="x", max_tokens=2)
    assert e.value.body["param"] == "model"
    req = urllib.request.Request(server[0] + "/v1/completions", data=b"{not json", method="POST",
                                 headers={"content-type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=30)
    assert e.value.code == 400 and "not valid JSON" in json.loads(e.value.read())["error"]["message"]


def test_health_and_models(client, server):
    with urllib.request.urlopen(server[0] + "/health", timeout=30) as r:
        assert r.status == 200
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_a_full_driver_is_a_429_with_retry_after(client):
    # max_pending is 64: a stream holding 60 requests leaves no room for 5 more.
    held = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=200, n=20, stream=True,
                                     extra_body={"ignore_eos": True})
    try:
        next(iter(held))
        with pytest.raises(openai.RateLimitError) as e:
            client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=2, n=5)
        assert e.value.response.headers["retry-after"] == "1"
    finally:
        held.close()
    # More than the driver could ever hold is no reason to retry: a 400 naming n.
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=2, n=32)
    assert e.value.body["param"] == "n"
    deadline = time.time() + 30
    while True:         # the held stream's requests are aborted between steps
        try:
            assert client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=2).choices
            break
        except openai.RateLimitError:
            assert time.time() < deadline
            time.sleep(0.2)


def test_48_concurrent_streams_each_equal_the_request_alone(server):
    url = server[0] + "/v1"
    prompts = [PROMPTS[i % 3] + "x" * (i % 5) for i in range(48)]

    async def one(c, i, stream):
        kw = dict(model=MODEL, prompt=prompts[i], max_tokens=12, temperature=0.7, seed=i)
        if not stream:
            return (await c.completions.create(**kw)).choices[0].text
        text = ""
        async for ch in await c.completions.create(stream=True, **kw):
            text += ch.choices[0].text
        return text

    async def run():
        async with openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0, timeout=300) as c:
            alone = [await one(c, i, False) for i in range(0, 48, 7)]
            together = await asyncio.gather(*(one(c, i, True) for i in range(48)))
        return alone, together

    alone, together = asyncio.run(run())
    assert len(together) == 48 and all(together)
    assert together[::7] == alone


def test_a_dropped_stream_aborts_its_request_and_frees_its_blocks(client, server):
    rt = server[1]
    before = rt.metrics()
    s = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=200, temperature=0, stream=True,
                                  extra_body={"ignore_eos": True})
    it = iter(s)
    next(it)
    assert rt.metrics()["num_running"] == 1
    s.close()                                    # the client goes away mid-stream
    deadline = time.time() + 30
    while time.time() < deadline:
        m = rt.metrics()
        if m["num_running"] == 0 and m["num_requests_held"] == 0 and not any(m["target_kv_blocks_used"]):
            break
        time.sleep(0.1)
    assert (m["num_running"], m["num_requests_held"], sum(m["target_kv_blocks_used"])) == (0, 0, 0)
    assert m["num_emitted_tokens"] - before["num_emitted_tokens"] < 200      # it did not run to the end
    assert m["num_requests_aborted"] == before["num_requests_aborted"] + 1
    assert client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=3).choices


def test_http_requests_reach_rays_prometheus_endpoint(client, ray_module):
    port = ray_module._private.worker.global_worker.node.metrics_export_port
    client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=3)
    deadline = time.time() + 60
    while time.time() < deadline:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        ok = [line for line in text.splitlines() if line.startswith("ray_specray_http_requests_total")
              and 'route="completions"' in line and 'status="200"' in line]
        if ok and float(ok[0].rsplit(" ", 1)[1]) >= 1:
            return
        time.sleep(1)
    raise AssertionError("ray_specray_http_requests_total never showed the completions answered")


def test_the_python_handle_takes_stop_strings_too(server):
    rt = server[1]
    full = rt.generate([PROMPTS[0]], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))[0]
    stop = full.text[5:7]
    got = rt.generate([PROMPTS[0]], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, stop=[stop]))[0]
    assert got.text == full.text[:full.text.index(stop)] and got.finish_reason == "stop"
    assert got.token_ids == full.token_ids[:len(got.token_ids)] and len(got.token_ids) < 30
    streamed = list(rt.stream(PROMPTS[0], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True,
                                                        stop=[stop])))
    assert "".join(d.text for d in streamed) == got.text


def _reference_logprobs(t: str, prompt: list[int], output: list[int]):
    """The target's own log-softmax at each emitted position, through transformers."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(t, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0]
    return torch.log_softmax(logits[len(prompt) - 1:len(prompt) + len(output) - 1].double(), dim=-1)


@pytest.mark.parametrize("stream", [False, True])
def test_logprobs_equal_the_targets_own_log_softmax(client, pair, stream):
    t, _, tok = pair
    prompt = PROMPTS[2]
    kw = dict(model=MODEL, prompt=prompt, max_tokens=16, temperature=0.9, seed=5, logprobs=3,
              extra_body={"ignore_eos": True})
    if stream:
        chunks = [ch for ch in client.completions.create(stream=True, **kw) if ch.choices]
        tokens = [x for ch in chunks for x in ch.choices[0].logprobs.tokens]
        values = [x for ch in chunks for x in ch.choices[0].logprobs.token_logprobs]
        tops = [x for ch in chunks for x in ch.choices[0].logprobs.top_logprobs]
        offsets = [x for ch in chunks for x in ch.choices[0].logprobs.text_offset]
        text = "".join(ch.choices[0].text for ch in chunks)
    else:
        c = client.completions.create(**kw).choices[0]
        tokens, values, tops = c.logprobs.tokens, c.logprobs.token_logprobs, c.logprobs.top_logprobs
        offsets, text = c.logprobs.text_offset, c.text
    assert len(tokens) == 16 and "".join(tokens) == text
    assert offsets == [sum(map(len, tokens[:i])) for i in range(16)]
    # Each token string names one id: map them back through the tokenizer to compare.
    output = [tok.convert_tokens_to_ids(tok.tokenize(s))[0] if s else 0 for s in tokens]
    ref = _reference_logprobs(t, ids_of(tok, prompt), output)
    for i, (value, top) in enumerate(zip(values, tops)):
        assert abs(value - ref[i, output[i]].item()) < 1e-4
        best = ref[i].topk(3)
        assert len(top) == 3
        assert sorted(top.values(), reverse=True) == pytest.approx(best.values.tolist(), abs=1e-4)


def test_chat_logprobs_name_each_token_with_its_bytes(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x = "}], max_tokens=6,
                                       temperature=0, logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert "".join(e.token for e in content) == r.choices[0].message.content
    for e in content:
        assert e.bytes == list(e.token.encode()) and len(e.top_logprobs) == 2
        assert e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob
        assert e.logprob <= e.top_logprobs[0].logprob + 1e-6       # greedy: the best token
        assert e.logprob == pytest.approx(e.top_logprobs[0].logprob, abs=1e-5)


def test_speculation_false_proposes_nothing_and_changes_nothing(client):
    kw = dict(model=MODEL, prompt=PROMPTS[0], max_tokens=20, temperature=0, extra_body={"ignore_eos": True})
    on = client.completions.create(**kw)
    off = client.completions.create(**{**kw, "extra_body": {"ignore_eos": True, "speculation": False}})
    assert off.choices[0].text == on.choices[0].text
    assert on.model_extra["specray"]["num_draft_tokens"] > 0
    assert off.model_extra["specray"] == {"num_draft_tokens": 0, "num_accepted_tokens": 0}


def test_a_stream_rides_through_a_driver_kill_with_the_same_text(client, server):
    """The driver's process SIGKILLed under an openai stream: Ray restarts it, the ingress
    resubmits the request from what it had sent, and the client's text equals the run
    without a kill (seeded sampling). Last in the module: the driver is a new process after."""
    import os
    import signal

    import ray

    rt = server[1]
    kw = dict(model=MODEL, prompt=PROMPTS[0], max_tokens=200, temperature=0.8, seed=5,
              extra_body={"ignore_eos": True})
    ref = client.completions.create(**kw).choices[0].text
    before = rt.metrics()["num_driver_restarts"]
    text, killed = "", False
    for ch in client.completions.create(stream=True, **kw):
        text += ch.choices[0].text
        if not killed and len(text) >= 6:
            os.kill(ray.get(rt._driver.pid.remote()), signal.SIGKILL)
            killed = True
    assert killed and text == ref
    assert rt.metrics()["num_driver_restarts"] == before + 1
    # It serves on, non-streaming too.
    assert client.completions.create(**kw).choices[0].text == ref


WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
ASK = [{"role": "user", "content": "The weather in Oslo for three days, as JSON."}]


def test_json_schema_answers_validate_and_json_object_answers_parse(client):
    import jsonschema

    r = client.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=80, temperature=0.7, seed=3, n=4,
        response_format={"type": "json_schema", "json_schema": {"name": "weather", "schema": WEATHER, "strict": True}})
    done = [c for c in r.choices if c.finish_reason == "stop"]
    assert done, [c.message.content for c in r.choices]
    for c in done:
        jsonschema.validate(json.loads(c.message.content), WEATHER)
    r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=80, temperature=0.7, seed=4, n=4,
                                       response_format={"type": "json_object"})
    done = [c for c in r.choices if c.finish_reason == "stop"]
    assert done and all(isinstance(json.loads(c.message.content), dict) for c in done)


def test_a_named_tool_call_comes_back_as_tool_calls_whose_arguments_validate(client):
    import jsonschema

    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
             {"type": "function", "function": {"name": "get_time"}}]
    r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=80, temperature=0.7, seed=5, n=3,
                                       tools=tools, tool_choice={"type": "function",
                                                                 "function": {"name": "get_weather"}})
    calls = [c for c in r.choices if c.finish_reason == "tool_calls"]
    assert calls, [c.message.content for c in r.choices]
    for c in calls:
        (call,) = c.message.tool_calls
        assert call.type == "function" and call.function.name == "get_weather" and c.message.content is None
        jsonschema.validate(json.loads(call.function.arguments), WEATHER)


@pytest.mark.parametrize("kw, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": {"type": "strnig"}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": {"if": {}, "then": {}}}}},
     "response_format"),
    ({"extra_body": {"structured_outputs": {"regex": "(unclosed"}}}, "structured_outputs"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
])
def test_structured_output_refusals_are_400s_naming_the_field_and_the_server_serves_on(client, kw, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, **kw)
    assert e.value.status_code == 400 and e.value.body["param"] == param
    r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=8, temperature=0.0,
                                       extra_body={"structured_outputs": {"choice": ["sunny", "rain"]}})
    assert r.choices[0].message.content in ("sunny", "rain") and r.choices[0].finish_reason == "stop"
