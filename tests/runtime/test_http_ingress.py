"""The ingress's own paths that a healthy server never takes, without Ray: a driver that
stops answering turns into 503s and an error chunk ending a stream with [DONE]; a stream
whose client goes away aborts its requests."""

from __future__ import annotations

import asyncio
import json

from ray import exceptions as rex

from specray.runtime import http_ingress, openai_protocol as api
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
            from specray.runtime.driver import PollReply

            return PollReply(deltas=[RequestOutput(ids[0], [1, 2], [5], "a")])
        raise rex.RayActorError()


def ingress(driver):
    ing = object.__new__(http_ingress.OpenAIIngress)
    ing.driver, ing.pump, ing.names = driver, http_ingress.DeltaPump(driver), {}
    ing.metrics = type("M", (), {"end": lambda *a, **k: None})()
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
            from specray.runtime.driver import PollReply

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
