"""The server's doors without a server (the real one: test_http_doors.py): which Host
values an entry admits, the key compared whatever the scheme, JSON with any charset, a
body cut at the cap even when its Content-Length lies, a key that never shows itself."""

from __future__ import annotations

import asyncio
import pickle

import pytest

from specray.runtime.entrypoints.openai.guard import DEFAULT_MAX_BODY_BYTES, Doors, Secret, default_hosts, host_set
from specray.runtime.entrypoints.openai.protocol import ApiError


def refused(fn, *args) -> ApiError:
    with pytest.raises(ApiError) as e:
        fn(*args)
    return e.value


def test_an_entry_admits_its_name_alone_or_with_the_bound_port_and_name_port_that_port_only():
    hosts = host_set(["localhost", "api.example:443", "::1", "[fe80::1]:9"], 8000)
    assert hosts == {"localhost", "localhost:8000", "api.example:443", "[::1]", "[::1]:8000", "[fe80::1]:9"}
    assert host_set(["a", "*"], 1) is None
    for bad in (["a:b"], [""], [" , "], ["http://localhost"], ["a b"]):
        with pytest.raises(ValueError, match="allowed_hosts"):
            host_set(bad, 1)


@pytest.mark.parametrize("host, ok", [("localhost", True), ("LocalHost:8000", True), ("localhost.:8000", True),
                                      ("127.0.0.1:8000", True), ("[::1]:8000", True), ("[::1]", True),
                                      ("localhost:8001", False), ("127.0.0.2", False), ("evil.example", False),
                                      ("localhost.evil.example", False), ("", False), (None, False),
                                      ("[::1", False), ("localhost:8000:1", False)])
def test_the_default_doors_answer_to_the_bound_address_and_loopback_names_only(host, ok):
    doors = Doors.build("127.0.0.1", 8000)
    if ok:
        doors.check_host(host)
    else:
        e = refused(doors.check_host, host)
        assert (e.status, e.code, e.type) == (400, "host_not_allowed", "invalid_request_error")


def test_a_wildcard_bind_adds_this_machines_name_and_star_admits_any_host():
    import socket

    assert socket.gethostname() in default_hosts("0.0.0.0")
    assert "0.0.0.0" not in default_hosts("0.0.0.0")
    assert default_hosts("10.1.2.3")[0] == "10.1.2.3"
    Doors.build("127.0.0.1", 8000, ["*"]).check_host("anything.example:1")
    Doors.build("127.0.0.1", 8000, ["api.example"]).check_host("api.example:8000")
    refused(Doors.build("127.0.0.1", 8000, ["api.example"]).check_host, "localhost")    # the list replaces


def test_the_key_is_required_as_a_bearer_token_and_compared_whole():
    doors = Doors.build("127.0.0.1", 8000, api_key="sk-abc")
    doors.check_key("Bearer sk-abc")
    doors.check_key("bearer   sk-abc ")
    for bad in (None, "", "sk-abc", "Basic sk-abc", "Bearer sk-ab", "Bearer sk-abcd", "Bearer", "Bearer sk-abc x"):
        e = refused(doors.check_key, bad)
        assert (e.status, e.code, e.type) == (401, "invalid_api_key", "invalid_request_error")
        assert "sk-abc" not in e.message
    Doors.build("127.0.0.1", 8000).check_key(None)            # no key set: nothing asked


def test_post_bodies_must_be_json_with_any_charset():
    Doors.check_json("application/json")
    Doors.check_json("Application/JSON; charset=UTF-8")
    for bad in (None, "", "text/plain", "application/jsonx", "application/x-www-form-urlencoded",
                "multipart/form-data; boundary=a", "text/plain; application/json"):
        assert refused(Doors.check_json, bad).status == 415


class FakeRequest:
    def __init__(self, chunks: list[bytes], content_length: str | None = None) -> None:
        self.headers = {} if content_length is None else {"content-length": content_length}
        self.chunks = chunks
        self.read = 0

    async def stream(self):
        for c in self.chunks:
            self.read += 1
            yield c


def test_the_body_is_read_no_further_than_the_cap_whatever_its_length_says():
    doors = Doors(max_body_bytes=10)
    assert asyncio.run(doors.read_body(FakeRequest([b"12345", b"67890"], "10"))) == b"1234567890"
    assert asyncio.run(doors.read_body(FakeRequest([b"12345", b"67890"]))) == b"1234567890"
    # Announced too large: refused before a byte is read.
    req = FakeRequest([b"x" * 11], "11")
    with pytest.raises(ApiError) as e:
        asyncio.run(doors.read_body(req))
    assert (e.value.status, e.value.code, req.read) == (413, "request_too_large", 0)
    # A Content-Length that lies, or none: cut at the chunk that passes the cap.
    for length in ("3", None):
        req = FakeRequest([b"123456", b"789012", b"never read"], length)
        with pytest.raises(ApiError) as e:
            asyncio.run(doors.read_body(req))
        assert (e.value.status, req.read) == (413, 2)
    with pytest.raises(ApiError) as e:
        asyncio.run(doors.read_body(FakeRequest([b"{}"], "-1")))
    assert e.value.status == 400


def test_the_key_never_shows_itself_and_crosses_pickling():
    doors = Doors.build("127.0.0.1", 8000, api_key="sk-secret")
    assert "sk-secret" not in repr(doors) and "sk-secret" not in str(doors.api_key)
    assert pickle.loads(pickle.dumps(doors)).api_key.value == "sk-secret"
    assert Doors().max_body_bytes == DEFAULT_MAX_BODY_BYTES and Doors().api_key is None
    for bad in (dict(max_body_bytes=0), dict(max_body_bytes=True), dict(api_key=Secret("")),
                dict(api_key="sk-plain")):
        with pytest.raises(ValueError):
            Doors(**bad)
