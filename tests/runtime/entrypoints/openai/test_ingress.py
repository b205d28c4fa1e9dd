"""The ingress's own paths that a healthy server never takes, without Ray: a driver that
stops answering turns into 503s and an error chunk ending a stream with [DONE]; a stream
whose client goes away aborts its requests; a request that fails on the server's side
is told so with an error id alone, its details in the log."""

from __future__ import annotations

import asyncio
import json
import logging
import re

from ray import exceptions as rex
from starlette.requests import Request

from specray.runtime.entrypoints.openai import ingress as http_ingress
from specray.runtime.entrypoints.openai import protocol as api
from specray.runtime.request_output import RequestOutput


class Remote:
    def __init__(self, fn):
        self.fn = fn

    def remote(self, *args):
        return self.fn(*args)


class DeadDriver:
    """Answers one poll with a first delta, then is gone."""

    def __init__(self) -> None:
        self.polls = 0
        self.aborted: list[list[str]] = []
        self.poll_many = Remote(self._poll)
        self.abort = Remote(lambda ids: self.aborted.append(ids))

    async def _poll(self, ids, timeout):
        self.polls += 1
        if self.polls == 1:
            from specray.runtime.driver.replies import PollReply

            return PollReply(deltas=[RequestOutput(ids[0], [1, 2], [5], "a")])
        raise rex.RayActorError()


def ingress(driver):
    from specray.runtime.entrypoints.openai.guard import Doors

    ing = object.__new__(http_ingress.OpenAIIngress)
    ing.driver, ing.pump, ing.names = driver, http_ingress.DeltaPump(driver), {}
    ing.metrics = type("M", (), {"end": lambda *a, **k: None, "begin": lambda *a: 0.0})()
    ing.doors, ing.served, ing.max_model_len, ing.max_choices = Doors.build("127.0.0.1", 8000), "m", 64, 16
    ing.has_chat_template = False
    return ing


def request():
    return api.parse_completion({"model": "m", "prompt": "x", "stream": True}, "m", 64)


async def collect(gen, stop_after: int | None = None) -> list[str]:
    out = []
    async for piece in gen:
        out.append(piece)
        if stop_after is not None and len(out) == stop_after:
            await gen.aclose()
            break
    return out


def test_a_driver_lost_mid_stream_sends_an_error_chunk_then_done(monkeypatch):
    monkeypatch.setattr(http_ingress, "RETRY_S", 0.0)
    drv = DeadDriver()
    ing = ingress(drv)

    async def run():
        queues = ing.pump.open(["r1"])
        return await collect(ing._stream(request(), ["r1"], queues, "completions", 0.0))

    pieces = asyncio.run(run())
    first = json.loads(pieces[0][6:])
    assert first["choices"][0]["text"] == "a"
    err = json.loads(pieces[1][6:])
    assert err["error"]["type"] == "service_unavailable" and "unavailable" in err["error"]["message"]
    assert pieces[-1] == "data: [DONE]\n\n" and len(pieces) == 3
    assert drv.aborted == [["r1"]]          # what it had asked for is called off


def test_a_client_that_goes_away_aborts_its_requests():
    class Slow(DeadDriver):
        async def _poll(self, ids, timeout):
            from specray.runtime.driver.replies import PollReply

            self.polls += 1
            await asyncio.sleep(0.01)
            return PollReply(deltas=[RequestOutput(i, [1], [5], "b") for i in ids])

    drv = Slow()
    ing = ingress(drv)

    async def run():
        queues = ing.pump.open(["r1", "r2"])
        return await collect(ing._stream(request(), ["r1", "r2"], queues, "completions", 0.0), stop_after=2)

    assert len(asyncio.run(run())) == 2
    assert drv.aborted == [["r1", "r2"]] and ing.pump.queues == {}


def test_submit_to_a_driver_that_does_not_answer_is_a_503():
    drv = DeadDriver()

    async def dead_submit(prompts, params):
        raise rex.RayActorError()

    drv.submit = Remote(dead_submit)
    ing = ingress(drv)
    try:
        asyncio.run(ing._submit(request()))
    except api.ApiError as e:
        assert e.status == 503 and e.retry_after_s == 1
    else:
        raise AssertionError("no 503")


class Done:
    """What ``.remote()`` returns, awaited or not (as an ObjectRef)."""

    def __await__(self):
        return iter(())


class RestartingDriver(DeadDriver):
    """Streams a request's output two tokens a poll, dies once after the first poll, comes
    back empty (it knows no request ids), and serves what is resubmitted to it from the
    resume point: a restarted driver as the pump meets it."""

    OUT = [5, 6, 7, 8, 9, 10]

    def __init__(self, down_polls: int = 1) -> None:
        super().__init__()
        self.down = down_polls
        self.held: dict[str, int] = {}           # id -> tokens sent
        self.resumed: list = []
        self.info = Remote(self._info)
        self.submit = Remote(self._submit)
        self.abort = Remote(self._abort)

    def _abort(self, ids):
        self.aborted.append(ids)
        return Done()

    async def _info(self):
        if self.down:
            self.down -= 1
            raise rex.ActorUnavailableError("restarting", None)
        return "info"

    async def _submit(self, prompts, params, resumes=None):
        from specray.runtime.driver.replies import SubmitReply

        self.resumed.append(resumes)
        ids = [f"new{i}" for i in range(len(prompts))]
        for rid, r in zip(ids, resumes):
            self.held[rid] = len(r.token_ids) if r else 0
        return SubmitReply(ids, seeds=[p.seed for p in params])

    async def _poll(self, ids, timeout):
        from specray.runtime.driver.replies import PollReply

        await asyncio.sleep(0.001)          # a call to Ray suspends the pump
        self.polls += 1
        if self.polls == 2:
            self.held.clear()
            raise rex.ActorUnavailableError("died", None)
        reply = PollReply()
        for rid in ids:
            if rid not in self.held:
                reply.unknown.append(rid)
                continue
            n = self.held[rid]
            new = self.OUT[n:n + 2]
            self.held[rid] = n + len(new)
            done = self.held[rid] == len(self.OUT)
            reply.deltas.append(RequestOutput(rid, [1, 2], new, "".join(chr(96 + t) for t in new),
                                              "length" if done else None))
        return reply


def stream_through_restart(drv: RestartingDriver):
    """One stream ("r1", seed 42) through an ingress over ``drv``: (the ingress, its SSE pieces)."""
    drv.held["r1"] = 0
    ing = ingress(drv)
    req = request()

    async def run():
        queues = ing.pump.open(["r1"], req.prompts, req.params, [42])
        return await collect(ing._stream(req, ["r1"], queues, "completions", 0.0))

    return ing, asyncio.run(run())


def test_a_stream_rides_through_a_driver_restart(monkeypatch):
    monkeypatch.setattr(http_ingress, "RETRY_S", 0.0)
    drv = RestartingDriver()
    ing, pieces = stream_through_restart(drv)
    texts = [json.loads(p[6:])["choices"][0]["text"] for p in pieces[:-1]]
    assert "".join(texts) == "efghij" and pieces[-1] == "data: [DONE]\n\n"
    (resume,) = drv.resumed[0]
    # Resubmitted from what it had received: the prompt's ids, two tokens, their text.
    assert (resume.prompt_token_ids, resume.token_ids, resume.text_len) == ([1, 2], [5, 6], 2)
    assert drv.aborted == [["r1"]] and ing.pump.flight.requests == {}


def test_a_driver_that_does_not_come_back_in_time_ends_the_stream_with_an_error(monkeypatch, caplog):
    monkeypatch.setattr(http_ingress, "RETRY_S", 0.0)
    monkeypatch.setattr(http_ingress, "RESTART_S", 0.2)
    caplog.set_level(logging.ERROR, logger="specray.http")
    _, pieces = stream_through_restart(RestartingDriver(down_polls=10**9))
    err = json.loads(pieces[-2][6:])["error"]
    eid = re.fullmatch(r"the specray driver is unavailable; retry shortly \(error id ([0-9a-f]{8})\)",
                       err["message"]).group(1)
    assert err["type"] == "service_unavailable" and "did not serve again" in logged(caplog, eid)
    assert pieces[-1] == "data: [DONE]\n\n"


def http_request(body: dict) -> Request:
    """A POST as Starlette hands it to a route."""
    raw = json.dumps(body).encode()
    headers = [(b"host", b"127.0.0.1:8000"), (b"content-type", b"application/json")]
    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": headers, "query_string": b""}
    sent = False

    async def receive():
        nonlocal sent
        if sent:
            return {"type": "http.disconnect"}
        sent = True
        return {"type": "http.request", "body": raw, "more_body": False}

    return Request(scope, receive)


class FailingDriver(DeadDriver):
    """Takes a request, then reports it failed with the driver's own words (which name
    the exception of a step that another request broke)."""

    DETAIL = "OverflowError: int too large to convert to float (request 7-secret)"

    def __init__(self) -> None:
        super().__init__()
        self.submit = Remote(self._submit)

    async def _submit(self, prompts, params, resumes=None):
        from specray.runtime.driver.replies import SubmitReply

        return SubmitReply([f"r{i}" for i in range(len(prompts))], seeds=[1] * len(prompts))

    async def _poll(self, ids, timeout):
        from specray.runtime.driver.replies import PollReply

        await asyncio.sleep(0.001)
        return PollReply(errors={i: self.DETAIL for i in ids})


GENERIC = re.compile(r"the server failed to complete this request \(error id ([0-9a-f]{8})\)")


def logged(caplog, eid: str) -> str:
    return "\n".join(r.getMessage() + (r.exc_text or "") for r in caplog.records
                     if r.name == "specray.http" and eid in r.getMessage())


def test_a_failed_request_is_told_only_its_error_id_and_the_log_has_the_rest(caplog):
    caplog.set_level(logging.ERROR, logger="specray.http")
    drv = FailingDriver()
    ing = ingress(drv)
    r = asyncio.run(ing._generate(http_request({"model": "m", "prompt": "x"}), "completions"))
    err = json.loads(r.body)["error"]
    assert r.status_code == 500 and err["type"] == "server_error"
    eid = GENERIC.fullmatch(err["message"]).group(1)
    assert FailingDriver.DETAIL in logged(caplog, eid)
    assert drv.aborted == [["r0"]]


def test_a_failed_stream_ends_with_a_generic_chunk_then_done(caplog):
    caplog.set_level(logging.ERROR, logger="specray.http")
    ing = ingress(FailingDriver())

    async def run():
        queues = ing.pump.open(["r1"])
        return await collect(ing._stream(request(), ["r1"], queues, "completions", 0.0))

    pieces = asyncio.run(run())
    assert len(pieces) == 2 and pieces[-1] == "data: [DONE]\n\n"
    err = json.loads(pieces[0][6:])["error"]
    eid = GENERIC.fullmatch(err["message"]).group(1)
    assert FailingDriver.DETAIL in logged(caplog, eid)


def test_an_unexpected_failure_in_the_ingress_is_a_generic_500(monkeypatch, caplog):
    caplog.set_level(logging.ERROR, logger="specray.http")

    def broken(*a, **k):
        raise KeyError("a detail for the log only")

    monkeypatch.setattr(api, "parse_completion", broken)
    r = asyncio.run(ingress(FailingDriver())._generate(http_request({"model": "m", "prompt": "x"}), "completions"))
    err = json.loads(r.body)["error"]
    assert r.status_code == 500 and "detail" not in err["message"]
    eid = GENERIC.fullmatch(err["message"]).group(1)
    text = logged(caplog, eid)
    assert "a detail for the log only" in text and "Traceback" in text
