"""The HTTP server's doors, through a real server on 127.0.0.1 with an API key and a small
body cap: 401 without the key or with a wrong one, ``/health`` open; 413 past the cap
whether or not the body says its length; 415 for anything but JSON; 400 for a Host the
server does not answer to; a body asking for more choices than the driver holds refused
whole; the key in no log. Then a fuzzer (hypothesis) sends a few hundred valid-ish and
hostile completion and chat bodies while a seeded stream runs beside them: every answer
is a 2xx or a 4xx, never a 5xx, and the stream's text is its text alone."""

from __future__ import annotations

import http.client
import json
import os
import secrets
import shutil
import sys
import threading
import time

import openai
import pytest
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st
from specray_testing import free_port

from specray import RuntimeConfig, SpecRuntime
from specray.runtime.model_store import builtin_model

DRIVER = NAMESPACE = "specray-http-doors"
MODEL = "tiny"
KEY = "sk-" + secrets.token_hex(16)
MAX_BODY = 64 * 1024
MAX_PENDING = 16
MAX_MODEL_LEN = 96
TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")


@pytest.fixture(scope="module")
def server(ray_module, tmp_path_factory):
    from transformers import AutoTokenizer

    from specray.runtime.entrypoints.openai.guard import Doors
    from specray.runtime.entrypoints.openai.ingress import start_http, stop_http

    root = tmp_path_factory.mktemp("doors")
    t, d = str(root / "tiny-target"), str(root / "tiny-draft")
    shutil.copytree(builtin_model("tiny-target"), t)
    shutil.copytree(builtin_model("tiny-draft"), d)
    tok = AutoTokenizer.from_pretrained(t)
    tok.chat_template = TEMPLATE
    tok.save_pretrained(t)
    rt = SpecRuntime(RuntimeConfig(target=t, draft=d, num_speculative_tokens=4, device="cpu", dtype="float32",
                                   max_model_len=MAX_MODEL_LEN, name=DRIVER, namespace=NAMESPACE,
                                   max_pending=MAX_PENDING))
    port = free_port()
    try:
        url = start_http(DRIVER, NAMESPACE, MODEL, port=port,
                         doors=Doors.build("127.0.0.1", port, api_key=KEY, max_body_bytes=MAX_BODY))
        yield port, url, rt
    finally:
        try:
            stop_http()
        finally:
            rt.shutdown()


def call(port: int, method: str, path: str, body: bytes | None = None, headers: dict | None = None,
         chunked: bool = False, host: str | None = None) -> tuple[int, dict, bytes]:
    """One request as given (``host`` None: the server's own address); (status, headers,
    body). ``chunked`` sends the body without a Content-Length."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        conn.putrequest(method, path, skip_host=True, skip_accept_encoding=True)
        conn.putheader("Host", host if host is not None else f"127.0.0.1:{port}")
        for k, v in (headers or {}).items():
            conn.putheader(k, v)
        if body is not None and chunked:
            conn.putheader("Transfer-Encoding", "chunked")
            conn.endheaders()
            for i in range(0, len(body), 65536):
                piece = body[i:i + 65536]
                try:
                    conn.send(b"%x\r\n%s\r\n" % (len(piece), piece))
                except (BrokenPipeError, ConnectionResetError):
                    break               # the server answered and closed before it all went
            else:
                conn.send(b"0\r\n\r\n")
        else:
            if body is not None:
                conn.putheader("Content-Length", str(len(body)))
            conn.endheaders()
            if body is not None:
                try:
                    conn.send(body)
                except (BrokenPipeError, ConnectionResetError):
                    pass
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    finally:
        conn.close()


AUTH = {"Authorization": f"Bearer {KEY}"}
JSON_AUTH = {**AUTH, "Content-Type": "application/json"}


def post(port: int, body, headers: dict | None = None, path: str = "/v1/completions", **kw):
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return call(port, "POST", path, raw, JSON_AUTH if headers is None else headers, **kw)


def completion(**kw) -> dict:
    return {"model": MODEL, "prompt": "def add(a, b):", "max_tokens": 3, **kw}


def error_of(status_headers_body) -> dict:
    return json.loads(status_headers_body[2])["error"]


def test_health_is_open_without_a_key_and_to_any_host(server):
    port = server[0]
    status, _, body = call(port, "GET", "/health", host="rebound.example")
    assert (status, json.loads(body)) == (200, {"status": "ok"})


@pytest.mark.parametrize("method, path", [("GET", "/v1/models"), ("POST", "/v1/completions"),
                                          ("POST", "/v1/chat/completions")])
def test_v1_routes_answer_401_without_the_key(server, method, path):
    port = server[0]
    body = json.dumps(completion()).encode() if method == "POST" else None
    for auth in ({}, {"Authorization": "Bearer sk-wrong"}, {"Authorization": f"Basic {KEY}"},
                 {"Authorization": KEY}, {"Authorization": f"Bearer {KEY}x"}):
        r = call(port, method, path, body, {"Content-Type": "application/json", **auth})
        assert r[0] == 401, (auth, r)
        err = error_of(r)
        assert (err["type"], err["code"]) == ("invalid_request_error", "invalid_api_key")
        assert KEY not in r[2].decode() and r[1]["www-authenticate"] == "Bearer"


def test_the_key_opens_them_through_the_openai_client(server):
    url = server[1]
    good = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    assert [m.id for m in good.models.list().data] == [MODEL]
    r = good.completions.create(model=MODEL, prompt="import os\n", max_tokens=4, temperature=0)
    assert r.choices[0].finish_reason in ("length", "stop")
    chat = good.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    assert chat.choices[0].message.role == "assistant"
    bad = openai.OpenAI(base_url=url + "/v1", api_key="sk-not-it", max_retries=0, timeout=60)
    with pytest.raises(openai.AuthenticationError) as e:
        bad.completions.create(model=MODEL, prompt="x", max_tokens=2)
    assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"


def test_a_body_past_the_cap_is_a_413_whether_or_not_it_says_its_length(server):
    port = server[0]
    big = json.dumps(completion(prompt="x" * (MAX_BODY + 10))).encode()
    for chunked in (False, True):
        r = post(port, big, chunked=chunked)
        assert r[0] == 413, (chunked, r[:2])
        assert error_of(r)["code"] == "request_too_large" and "--max-body-bytes" in error_of(r)["message"]
    # 40 MB, announced or not: refused, without reading it whole.
    huge = b"[" + b"0," * (20 * 2**20) + b"0]"
    for chunked in (False, True):
        t0 = time.monotonic()
        r = post(port, huge, chunked=chunked)
        assert r[0] == 413 and time.monotonic() - t0 < 30
    # Just under the cap (padded with JSON whitespace) is taken.
    fits = json.dumps(completion()).encode()
    fits += b" " * (MAX_BODY - len(fits))
    r = post(port, fits, chunked=True)
    assert r[0] == 200 and json.loads(r[2])["choices"][0]["text"] is not None


@pytest.mark.parametrize("content_type, status", [(None, 415), ("text/plain", 415),
                                                  ("application/x-www-form-urlencoded", 415),
                                                  ("multipart/form-data; boundary=x", 415),
                                                  ("application/json; charset=utf-8", 200),
                                                  ("Application/JSON", 200)])
def test_post_routes_take_json_only(server, content_type, status):
    port = server[0]
    headers = dict(AUTH, **({"Content-Type": content_type} if content_type else {}))
    for path in ("/v1/completions", "/v1/chat/completions"):
        body = completion() if path == "/v1/completions" else {"model": MODEL, "max_tokens": 2,
                                                               "messages": [{"role": "user", "content": "x"}]}
        r = post(port, body, headers, path=path)
        assert r[0] == status, (path, r)
        if status == 415:
            assert error_of(r)["code"] == "unsupported_media_type"


@pytest.mark.parametrize("host, status", [("rebound.example", 400), ("rebound.example:{port}", 400),
                                          ("localhost:1", 400), ("", 400), ("127.0.0.1", 200),
                                          ("localhost:{port}", 200), ("LOCALHOST.:{port}", 200),
                                          ("[::1]:{port}", 200)])
def test_a_host_the_server_does_not_answer_to_is_a_400(server, host, status):
    port = server[0]
    r = call(port, "GET", "/v1/models", headers=AUTH, host=host.format(port=port))
    assert r[0] == status, (host, r)
    if status == 400:
        assert error_of(r)["code"] == "host_not_allowed"
        r = post(port, completion(), host=host.format(port=port))
        assert r[0] == 400 and error_of(r)["code"] == "host_not_allowed"


@pytest.mark.parametrize("body, path, param", [
    (completion(prompt=["a", "b", "c", "d", "e"], n=4), "/v1/completions", "n"),
    (completion(prompt=["a"] * (MAX_PENDING + 1)), "/v1/completions", "prompt"),
    (completion(prompt=[[5, 6]] * 5000), "/v1/completions", "prompt"),
    (completion(prompt="a", n=MAX_PENDING + 1), "/v1/completions", "n"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "n": 100}, "/v1/chat/completions", "n"),
])
def test_more_choices_than_the_driver_holds_are_refused_naming_the_field(server, body, path, param):
    r = post(server[0], body, path=path)
    assert r[0] == 400 and error_of(r)["param"] == param, r
    assert str(MAX_PENDING) in error_of(r)["message"]


def test_deep_nesting_and_bad_json_are_400s(server):
    port = server[0]
    for raw in (b"[" * 20000 + b"]" * 20000, b'{"model": "tiny", "prompt": ' + b"[" * 3000 + b"]" * 3000 + b"}",
                b"\xff\xfe{", b'{"max_tokens": ' + b"9" * 5000 + b"}", b"{"):
        r = post(port, raw)
        assert r[0] == 400, (raw[:40], r)


# -- the fuzzer ----------------------------------------------------------------------------

HUGE = st.sampled_from([2**31, 2**32 + 1, 2**63, 2**64, -2**63 - 1, 10**30, 10**300, 10**400, -1, 0, -(10**20)])
NUMBER = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-10**6, 10**6), HUGE,
                   st.sampled_from(["NaN", "Infinity", "-inf", "1e999", "0x10", "", "1"]))
ODD_TEXT = st.sampled_from(["", "\x00", "\ud800", "\udfff x", "\u202e\u0301", "🙂" * 20, "a" * 2000, " ", "\n\n",
                            "<|endoftext|>", "{{ 7*7 }}", "%s%n", "\\u0000"])
TEXT = st.one_of(st.text(max_size=30), ODD_TEXT)
JUNK = st.recursive(st.none() | st.booleans() | NUMBER | TEXT,
                    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=6), kids, max_size=4),
                    max_leaves=10)


TOKEN_IDS = st.lists(st.integers(0, 96), min_size=1, max_size=12)
# Per field: values it takes, and hostile ones (wrong types, huge or negative numbers,
# NaN and its spellings, nesting, odd unicode).
FIELDS = {
    "max_tokens": (st.integers(1, 12), st.one_of(HUGE, JUNK)),
    "temperature": (st.floats(0, 2), NUMBER),
    "top_p": (st.floats(0.05, 1), NUMBER),
    "top_k": (st.integers(-1, 50), st.one_of(HUGE, JUNK)),
    "n": (st.integers(1, 3), st.one_of(HUGE, st.integers(-3, 10**9), JUNK)),
    "seed": (st.integers(0, 2**63 - 1), st.one_of(HUGE, JUNK)),
    "stop": (st.one_of(TEXT, st.lists(TEXT, max_size=3)), st.one_of(st.lists(TEXT, min_size=9), JUNK)),
    "stop_token_ids": (st.lists(st.integers(0, 96), max_size=3), st.one_of(st.lists(HUGE, min_size=1), JUNK)),
    "ignore_eos": (st.booleans(), JUNK),
    "stream": (st.booleans(), JUNK),
    "stream_options": (st.fixed_dictionaries({"include_usage": st.booleans()}), JUNK),
    "speculation": (st.booleans(), JUNK),
    "presence_penalty": (st.just(0), NUMBER),
    "user": (st.text(max_size=10), JUNK),
}
PROMPT = (st.one_of(st.text(min_size=1, max_size=40), st.lists(st.text(min_size=1, max_size=20), min_size=1,
                                                                max_size=3),
                    TOKEN_IDS, st.lists(TOKEN_IDS, min_size=1, max_size=3)),
          st.one_of(ODD_TEXT, st.lists(st.one_of(HUGE, st.integers(-5, 10**6)), max_size=4), JUNK))
MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant"]), "content": st.one_of(
    st.text(max_size=40), ODD_TEXT, st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": TEXT}),
                                             min_size=1, max_size=3))})
ROUTES = {
    "/v1/completions": {**FIELDS, "prompt": PROMPT, "logprobs": (st.integers(0, 5), st.one_of(HUGE, JUNK)),
                        "echo": (st.just(False), JUNK)},
    "/v1/chat/completions": {**FIELDS, "messages": (st.lists(MESSAGE, min_size=1, max_size=3), st.one_of(
                                 st.lists(st.fixed_dictionaries({"role": JUNK, "content": JUNK}), max_size=2), JUNK)),
                             "logprobs": (st.booleans(), JUNK),
                             "top_logprobs": (st.integers(0, 20), st.one_of(HUGE, JUNK)),
                             "max_completion_tokens": (st.integers(1, 12), st.one_of(HUGE, JUNK))},
}
REQUIRED = {"/v1/completions": "prompt", "/v1/chat/completions": "messages"}
UNKNOWN = st.dictionaries(st.text(min_size=1, max_size=10).filter(lambda k: k not in ROUTES["/v1/completions"]
                                                                  and k not in ROUTES["/v1/chat/completions"]),
                          JUNK, max_size=2)


def valid(path: str):
    """A body of values the route takes (some requests still refused: a stop string the
    vocabulary lacks, a prompt past the window)."""
    fields = ROUTES[path]
    req = REQUIRED[path]
    return st.fixed_dictionaries({"model": st.just(MODEL), req: fields[req][0]},
                                 optional={k: v[0] for k, v in fields.items() if k != req})


def one_hostile(path: str):
    """A valid body with one field hostile (or unknown fields added)."""
    names = sorted(ROUTES[path])
    return st.one_of(
        st.tuples(valid(path), st.sampled_from(names).flatmap(lambda k: st.tuples(st.just(k), ROUTES[path][k][1])))
        .map(lambda bf: {**bf[0], bf[1][0]: bf[1][1]}),
        st.tuples(valid(path), UNKNOWN).map(lambda bu: {**bu[1], **bu[0]}),
        st.tuples(valid(path), st.one_of(st.text(max_size=8), JUNK)).map(lambda bm: {**bm[0], "model": bm[1]}))


BODIES = st.one_of(*(st.tuples(st.just(p), kind(p)) for p in ROUTES for kind in (valid, one_hostile, one_hostile)),
                   st.tuples(st.sampled_from(sorted(ROUTES)), JUNK))
# Bodies issue 48 found to fail a step (and with it every request in flight), tried every run.
KNOWN = [("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 4, **bad}) for bad in (
    {"temperature": 10**400}, {"temperature": 1, "top_k": 10**12}, {"temperature": 1, "top_k": 2**31},
    {"max_tokens": 10**400}, {"stop_token_ids": [10**400]}, {"logprobs": 10**400}, {"seed": 10**400},
    {"prompt": [10**400]}, {"temperature": 10**300, "top_p": 10**-400})] + [
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 4,
                              "temperature": 10**400})]
FUZZ_BODIES = int(os.environ.get("SPECRAY_FUZZ_BODIES", "200"))
FUZZ_BUDGET_S = float(os.environ.get("SPECRAY_FUZZ_BUDGET_S", "60"))


def examples(cases):
    def wrap(fn):
        for case in reversed(cases):
            fn = example(case)(fn)
        return fn
    return wrap


def read_answer(port: int, path: str, body) -> tuple[int, str]:
    """Send one fuzzed body; (status, what went wrong on the server's side or "")."""
    raw = json.dumps(body).encode()             # NaN and Infinity go as Python's JSON writes them
    status, headers, text = post(port, raw, path=path)
    if status >= 500:
        return status, text.decode(errors="replace")[:500]
    if status == 200 and headers.get("content-type", "").startswith("text/event-stream"):
        for line in text.decode().splitlines():
            if line.startswith("data: {") and '"error"' in line[:12]:
                return 200, line[:500]          # a stream that failed after it began
        if not text.decode().rstrip().endswith("data: [DONE]"):
            return 200, "a stream without data: [DONE]"
    return status, ""


def too_big_for_a_float(body) -> bool:
    """A body issue 48's H1 is about: a sampling number JSON takes as an integer that no
    float holds."""
    def big(v):
        return isinstance(v, int) and not isinstance(v, bool) and abs(v) > sys.float_info.max

    return isinstance(body, dict) and any(big(body.get(k)) for k in ("temperature", "top_p"))


def h1_unfixed() -> bool:
    from specray import SamplingParams

    try:
        SamplingParams(temperature=10**400)
    except (ValueError, OverflowError):
        return False
    return True


def seeded_stream(url: str) -> str:
    c = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=120)
    text = ""
    for ch in c.completions.create(model=MODEL, prompt="class Config:\n    def __init__(self", max_tokens=60,
                                   temperature=0.8, seed=4242, stream=True, extra_body={"ignore_eos": True}):
        text += ch.choices[0].text
    return text


def test_fuzzed_bodies_get_2xx_or_4xx_and_a_stream_beside_them_keeps_its_text(server):
    port, url, _ = server
    solo = seeded_stream(url)
    beside: list[str] = []
    errors: list[str] = []
    done = threading.Event()

    def run_beside():
        while not done.is_set():
            try:
                beside.append(seeded_stream(url))
            except Exception as e:
                errors.append(f"{type(e).__name__}: {e}")

    side = threading.Thread(target=run_beside, daemon=True)
    side.start()
    tried: list[int] = []
    statuses: dict[int, int] = {}
    findings: list[tuple[int, str, str, str, str]] = []
    deadline = time.monotonic() + FUZZ_BUDGET_S

    @settings(max_examples=FUZZ_BODIES, deadline=None, derandomize=True, database=None,
              phases=(Phase.explicit, Phase.generate), suppress_health_check=list(HealthCheck))
    @given(BODIES)
    @examples(KNOWN)
    def fuzz(case):
        if time.monotonic() > deadline:
            return
        path, body = case
        status, problem = read_answer(port, path, body)
        tried.append(status)
        statuses[status] = statuses.get(status, 0) + 1
        if status >= 500 or problem or not 200 <= status < 500:
            findings.append((status, path, "h1" if too_big_for_a_float(body) else "", json.dumps(body)[:300], problem))

    try:
        fuzz()
    finally:
        done.set()
        side.join(timeout=180)
    print(f"\nfuzzer: {len(tried)} bodies tried in {FUZZ_BUDGET_S - (deadline - time.monotonic()):.1f} s; "
          f"statuses {dict(sorted(statuses.items()))}; the seeded stream ran {len(beside)} times beside them, "
          f"{sum(t != solo for t in beside)} with another text, {len(errors)} failed")
    for f in findings:
        print("finding:", f)
    assert len(tried) >= min(FUZZ_BODIES, 100), "the fuzzer ran out of time before 100 bodies"
    # A request or stream that failed was told so generically: no other request's error, no traceback.
    told = [f[4] for f in findings if f[0] >= 500] + [e.split(":", 1)[1] for e in errors]
    assert all("error id" in t and "Error:" not in t for t in told), told[:3]
    others = [f for f in findings if not (h1_unfixed() and f[2] == "h1")]
    assert not others, f"{len(others)} bodies got a 5xx or a broken stream; first: {others[0]}"
    if findings:
        # Only the step failure issue 48 reported (H1), which another change fixes
        # (scheduler/sampling_params.py, runtime/driver/core.py): its body fails every request in
        # flight, the stream beside it included.
        pytest.xfail(f"issue 48 H1, not fixed in this checkout: {len(findings)} bodies with a number too large for "
                     f"a float got a 5xx; the seeded stream beside them failed {len(errors)} times")
    assert not errors and beside and all(t == solo for t in beside), (errors[:3], [t for t in beside if t != solo][:2])
    # Hostile bodies change nothing for the next client either.
    assert seeded_stream(url) == solo


def test_the_key_is_in_no_log(server):
    """Last: every request above has gone through the logs by now."""
    import ray

    logs = os.path.join(ray._private.worker.global_worker.node.get_session_dir_path(), "logs")
    hits = []
    for folder, _, files in os.walk(logs):
        for name in files:
            p = os.path.join(folder, name)
            try:
                with open(p, "rb") as f:
                    if KEY.encode() in f.read():
                        hits.append(p)
            except OSError:
                continue
    assert not hits, hits
