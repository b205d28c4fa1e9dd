"""One hostile request hurts nobody else (issue 48): through a real server (Ray Serve over
the built-in pair, as ``specray serve --http`` runs it), in both layouts, every body whose
values are out of range -- numbers past a float or an int32, non-finite floats, huge stop
strings and ids -- gets a 4xx (or is served within range), never a 5xx, while a seeded
stream beside them ends with exactly the text it has alone."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request

import pytest
from specray_testing import free_port

from specray import RuntimeConfig, SpecRuntime
from specray.runtime.model_store import builtin_model

DRIVER = "specray-hostile-test"
MODEL = "tiny"
SEEDED = {"model": MODEL, "prompt": "def parse_args(", "max_tokens": 64, "temperature": 0.9, "seed": 1234,
          "ignore_eos": True, "stream": True}
BASE = f'"model": "{MODEL}", "prompt": "def f(", "max_tokens": 4'

# Raw bodies: a JSON integer of 401 digits, or NaN, cannot be written with json.dumps.
HOSTILE = {
    "temperature 1 and 400 zeros": '{%s, "temperature": 1%s}' % (BASE, "0" * 400),
    "temperature -1 and 400 zeros": '{%s, "temperature": -1%s}' % (BASE, "0" * 400),
    "temperature 1e400 (inf)": '{%s, "temperature": 1e400}' % BASE,
    "temperature -Infinity": '{%s, "temperature": -Infinity}' % BASE,
    "top_p NaN": '{%s, "top_p": NaN}' % BASE,
    "top_p Infinity": '{%s, "top_p": Infinity}' % BASE,
    "top_p 1 and 400 zeros": '{%s, "top_p": 1%s}' % (BASE, "0" * 400),
    "top_k 10**12": '{%s, "top_k": %d}' % (BASE, 10**12),
    "top_k 2**31": '{%s, "top_k": %d}' % (BASE, 2**31),
    "top_k 10**400": '{%s, "top_k": 1%s}' % (BASE, "0" * 400),
    "seed 2**64": '{%s, "seed": %d}' % (BASE, 2**64),
    "seed -2**64": '{%s, "seed": %d}' % (BASE, -2**64),
    "max_tokens 10**30": '{%s, "max_tokens": %d}' % (BASE.replace(', "max_tokens": 4', ""), 10**30),
    "stop of 100k characters": json.dumps({"model": MODEL, "prompt": "def f(", "max_tokens": 4,
                                           "stop": ["x" * 100_000]}),
    "eight stops of 100k characters": json.dumps({"model": MODEL, "prompt": "def f(", "max_tokens": 4,
                                                  "stop": ["y" * 100_000] * 8}),
    "stop_token_ids 10**30": '{%s, "stop_token_ids": [1, %d]}' % (BASE, 10**30),
    "stop_token_ids 2**31": '{%s, "stop_token_ids": [%d]}' % (BASE, 2**31),
    "stop_token_ids past the vocabulary": '{%s, "stop_token_ids": [%d]}' % (BASE, 2**31 - 1),
    "prompt token id 10**30": '{"model": "%s", "prompt": [1, %d], "max_tokens": 4}' % (MODEL, 10**30),
    "prompt token id -1": '{"model": "%s", "prompt": [1, -1], "max_tokens": 4}' % MODEL,
    "logprobs 1 and 400 zeros": '{%s, "logprobs": 1%s}' % (BASE, "0" * 400),
    "n 10**30": '{%s, "n": %d}' % (BASE, 10**30),
    "a prompt of 2M characters": json.dumps({"model": MODEL, "prompt": "ab " * 700_000, "max_tokens": 4}),
}
# A top_k past the vocabulary but inside what a step packs: served, the filter off.
SERVED = {"top_k 10**6": '{%s, "top_k": 1000000, "temperature": 0.7, "seed": 5}' % BASE}
PLAIN = '{%s, "temperature": 0.7, "seed": 5}' % BASE


@pytest.fixture(scope="module", params=["colocated", "actors"])
def server(request, ray_module):
    from specray.runtime.entrypoints.openai.ingress import start_http, stop_http

    ns = f"{DRIVER}-{request.param}"
    rt = SpecRuntime(RuntimeConfig(target=builtin_model("tiny-target"), draft=builtin_model("tiny-draft"),
                                   num_speculative_tokens=3, device="cpu", dtype="float32", max_model_len=256,
                                   layout=request.param, name=ns, namespace=ns, max_pending=64))
    try:
        url = start_http(ns, ns, MODEL, port=free_port())
        yield url, rt, request.param
    finally:
        try:
            stop_http()
        finally:
            rt.shutdown()


def post(url: str, body: str | dict, timeout: float = 120) -> tuple[int, bytes]:
    data = (body if isinstance(body, str) else json.dumps(body)).encode()
    req = urllib.request.Request(url + "/v1/completions", data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def seeded_stream(url: str, started: threading.Event | None = None) -> str:
    """The seeded request's text, read as a stream; any error event fails it."""
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(SEEDED).encode(),
                                 headers={"Content-Type": "application/json"})
    text = []
    with urllib.request.urlopen(req, timeout=120) as r:
        for line in r:
            line = line.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: "):])
            assert "error" not in event, event
            text.append(event["choices"][0]["text"])
            if started is not None:
                started.set()
    return "".join(text)


def test_hostile_bodies_get_4xx_while_a_seeded_stream_beside_them_keeps_its_text(server):
    url, rt, layout = server
    alone = seeded_stream(url)
    assert alone
    got, started = {}, threading.Event()
    reader = threading.Thread(target=lambda: got.update(text=seeded_stream(url, started)), daemon=True)
    reader.start()
    assert started.wait(120)
    statuses = {name: post(url, body) for name, body in {**HOSTILE, **SERVED}.items()}
    reader.join(120)
    bad = {name: (status, body[:300]) for name, (status, body) in statuses.items()
           if not (400 <= status < 500 if name in HOSTILE else status == 200)}
    assert not bad, bad
    for name in HOSTILE:
        error = json.loads(statuses[name][1])["error"]
        assert error["message"], name
    assert got.get("text") == alone
    status, plain = post(url, PLAIN)
    assert status == 200
    assert json.loads(statuses["top_k 10**6"][1])["choices"] == json.loads(plain)["choices"]
    m = rt.metrics()
    assert m["layout"] == layout
    # Refused at the edge: none of them reached a step.
    assert m["num_failed_steps"] == 0 and m["num_requests_failed"] == 0
