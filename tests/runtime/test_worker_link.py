"""The worker link (runtime/worker_link.py) without Ray: calls answered in the order sent,
read in any order; tensors of any dtype intact, both ways; a worker's error reported and the link
serving on; an empty restart and a closed worker are a lost link; no token, no service."""

from __future__ import annotations

import socket
import threading

import pytest
import torch

from specray.runtime.worker_link import Link, LinkCallError, LinkLost, LinkServer
from specray.workers.errors import StaleCacheError


class Worker:
    """Answers ``op`` with its arguments back, a tensor where asked (``echo_tensors``: the
    tensors it received, stacked), and remembers the order."""

    def __init__(self) -> None:
        self.seen: list[int] = []
        self.release = threading.Event()
        self.release.set()

    def __call__(self, op, data, arg, tensors):
        self.release.wait(10)
        self.seen.append(arg)
        if op == "fail":
            raise ValueError(f"bad plan {arg}")
        if op == "stale":
            raise StaleCacheError("restarted empty")
        tensor = None
        if op == "tensor":
            dtype, shape = arg
            tensor = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape).to(getattr(torch, dtype))
        if op == "echo_tensors":
            tensor = torch.stack(tensors)
        return data + b"!", tensor


@pytest.fixture
def served():
    worker = Worker()
    server = LinkServer(worker, "127.0.0.1")
    yield worker, server
    server.close()


def test_replies_come_in_the_order_sent_and_are_read_in_any_order(served):
    worker, server = served
    link = Link(server.address, server.token)
    worker.release.clear()                 # three calls queue up behind the first
    calls = [link.send("echo", f"m{i}".encode(), i) for i in range(3)]
    worker.release.set()
    assert calls[2].result() == (b"m2!", None)      # read past the first two, kept for them
    assert calls[0].result() == (b"m0!", None) and calls[1].result() == (b"m1!", None)
    assert worker.seen == [0, 1, 2]
    link.close()


@pytest.mark.parametrize("dtype,shape", [("float32", [2, 3, 5]), ("bfloat16", [1, 4, 7]), ("float16", [0, 4, 7])])
def test_a_reply_tensor_arrives_intact(served, dtype, shape):
    _, server = served
    link = Link(server.address, server.token)
    message, tensor = link.send("tensor", b"p", (dtype, shape)).result()
    expected = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape).to(getattr(torch, dtype))
    assert message == b"p!" and tensor.dtype == expected.dtype and torch.equal(tensor, expected)
    link.close()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_call_tensors_arrive_intact_and_in_order(served, dtype):
    _, server = served
    link = Link(server.address, server.token)
    sent = [torch.randn(3, 2, 5).to(getattr(torch, dtype)) for _ in range(3)]
    first = link.send("echo_tensors", b"a", 1, tensors=sent)
    second = link.send("echo", b"b", 2, tensors=[torch.empty(0, 4)])      # an empty tensor sends no bytes
    message, got = first.result()
    assert message == b"a!" and got.dtype == sent[0].dtype and torch.equal(got, torch.stack(sent))
    assert second.result() == (b"b!", None)
    link.close()


@pytest.mark.parametrize("op,error,match,serves_on", [
    ("fail", LinkCallError, "ValueError: bad plan 1", True),      # the worker's error: that call only
    ("stale", LinkLost, "restarted empty", False),                # an empty restart: the link is lost
])
def test_a_failed_call(served, op, error, match, serves_on):
    _, server = served
    link = Link(server.address, server.token)
    bad, after = link.send(op, b"", 1), link.send("echo", b"x", 2)
    with pytest.raises(error, match=match):
        bad.result()
    if serves_on:
        assert after.result() == (b"x!", None)
    else:
        with pytest.raises(LinkLost):      # the link is closed: every call on it is lost
            after.result()
        with pytest.raises(LinkLost):
            link.send("echo", b"y", 3)
    link.close()


def test_a_worker_that_goes_away_fails_the_call_in_flight_at_once():
    accepted = []
    srv = socket.create_server(("127.0.0.1", 0))

    def accept_and_die():
        conn, _ = srv.accept()
        accepted.append(conn)
        conn.recv(64)                      # the token and the call, then the process "dies"
        conn.close()
    threading.Thread(target=accept_and_die, daemon=True).start()
    link = Link(srv.getsockname(), b"t" * 16)
    call = link.send("echo", b"x", 1)
    with pytest.raises(LinkLost):
        call.result()
    srv.close()


def test_a_connection_without_the_token_is_not_served(served):
    worker, server = served
    link = Link(server.address, b"\0" * 16)
    call = link.send("echo", b"x", 1)
    with pytest.raises(LinkLost):
        call.result()
    assert worker.seen == []
