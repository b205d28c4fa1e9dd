"""The worker link (runtime/transport/worker_link.py) without Ray: calls answered in the order sent,
read in any order; tensors of any allowed dtype intact, both ways; a worker's error reported
and the link serving on; an empty restart and a closed worker are a lost link.

And its locks: only the driver's address, at most two connections, a challenge-response on
the token (checked against an HMAC computed here), deadlines on connect and handshake,
bounded frames and tensors; whatever a stranger or a broken peer sends, the driver's own
link keeps answering."""

from __future__ import annotations

import errno
import hashlib
import hmac
import logging
import secrets
import socket
import struct
import threading
import time

import msgpack
import pytest
import torch

from specray.runtime.transport import link_auth, link_frames
from specray.runtime.transport.actor_handle import WorkerActor
from specray.runtime.transport.link_auth import HELLO, link_hosts, peer_allowed
from specray.runtime.transport.worker_link import (
    MAX_CONNECTIONS,
    Link,
    LinkCallError,
    LinkLost,
    LinkRefused,
    LinkServer,
)
from specray.workers.errors import StaleCacheError

HANDSHAKE_S = 0.5


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
            tensor = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape)
            tensor = tensor.to(getattr(torch, dtype))
        if op == "echo_tensors":
            tensor = torch.stack(tensors)
        return data + b"!", tensor


@pytest.fixture
def served():
    worker = Worker()
    server = LinkServer(worker, "127.0.0.1", "127.0.0.1", handshake_timeout_s=HANDSHAKE_S)
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


@pytest.mark.parametrize("dtype,shape", [("float32", [2, 3, 5]), ("bfloat16", [1, 4, 7]), ("float16", [0, 4, 7]),
                                         ("float64", [3, 2])])
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
    token = secrets.token_bytes(32)
    srv = socket.create_server(("127.0.0.1", 0))

    def accept_and_die():
        conn, _ = srv.accept()
        assert link_auth.challenge(conn, token)
        conn.recv(64)                      # the call, then the process "dies"
        conn.close()
    threading.Thread(target=accept_and_die, daemon=True).start()
    link = Link(srv.getsockname(), token)
    call = link.send("echo", b"x", 1)
    with pytest.raises(LinkLost):
        call.result()
    srv.close()


# --- the handshake --------------------------------------------------------------------------

def reference_proof(token, side, ns, nc, server_addr, client_addr) -> bytes:
    """The proof as the protocol defines it, computed here without link_auth."""
    bound = msgpack.packb([side, ns, nc, list(server_addr[:2]), list(client_addr[:2])], use_bin_type=True)
    return hmac.new(token, bound, hashlib.sha256).digest()


def read_until_closed(sock: socket.socket, timeout: float = 5.0) -> bytes:
    """Everything the peer sends until it closes (a reset too: it closed with our bytes
    unread); fails the test if it does not close in time."""
    sock.settimeout(timeout)
    got = b""
    try:
        while chunk := sock.recv(4096):
            got += chunk
    except ConnectionResetError:
        pass
    return got


def authenticated(server: LinkServer) -> socket.socket:
    """A raw connection past the handshake, to send frames by hand."""
    sock = socket.create_connection(server.address)
    link_auth.answer(sock, server.token)
    return sock


def test_the_driver_proves_the_token_by_hmac_and_never_sends_it():
    token = secrets.token_bytes(32)
    srv = socket.create_server(("127.0.0.1", 0))
    seen: dict = {}

    def worker_side():
        conn, peer = srv.accept()
        ns = secrets.token_bytes(32)
        conn.sendall(HELLO + ns)
        got = conn.recv(64, socket.MSG_WAITALL)
        nc, mac = got[:32], got[32:]
        seen["ok"] = hmac.compare_digest(mac, reference_proof(token, b"driver", ns, nc, conn.getsockname(), peer))
        seen["token_sent"] = token in got
        conn.sendall(reference_proof(token, b"worker", ns, nc, conn.getsockname(), peer))
        seen["after"] = conn.recv(1 << 16)
        conn.close()
    t = threading.Thread(target=worker_side, daemon=True)
    t.start()
    link = Link(srv.getsockname(), token)           # accepts the worker's reference proof
    link.send("echo", b"x", 1)
    t.join(5)
    assert seen["ok"] and not seen["token_sent"] and token not in seen["after"]
    link.close()
    srv.close()


def test_a_wrong_token_is_refused_both_ways(served):
    worker, server = served
    with pytest.raises(LinkRefused):                # the worker closes on a wrong proof
        Link(server.address, secrets.token_bytes(32))
    assert worker.seen == []

    srv = socket.create_server(("127.0.0.1", 0))    # a worker that cannot prove the token

    def impostor():
        conn, _ = srv.accept()
        conn.sendall(HELLO + secrets.token_bytes(32))
        conn.recv(64, socket.MSG_WAITALL)
        conn.sendall(secrets.token_bytes(32))
        conn.recv(1)
        conn.close()
    threading.Thread(target=impostor, daemon=True).start()
    with pytest.raises(LinkRefused, match="did not prove"):
        Link(srv.getsockname(), server.token)
    srv.close()


def test_a_proof_seen_on_the_wire_cannot_be_replayed(served):
    worker, server = served
    first = socket.create_connection(server.address)
    hello = first.recv(len(HELLO) + 32, socket.MSG_WAITALL)
    nc = secrets.token_bytes(32)
    answer = nc + reference_proof(server.token, b"driver", hello[len(HELLO):], nc, first.getpeername(),
                                  first.getsockname())
    first.sendall(answer)
    assert len(first.recv(32, socket.MSG_WAITALL)) == 32          # the genuine answer is accepted
    first.close()
    replay = socket.create_connection(server.address)
    assert replay.recv(len(HELLO) + 32, socket.MSG_WAITALL) != hello   # a fresh nonce
    replay.sendall(answer)
    assert read_until_closed(replay) == b""
    assert worker.seen == []


# --- who may connect ------------------------------------------------------------------------

@pytest.mark.parametrize("peer,allowed,ok", [
    ("127.0.0.1", "127.0.0.1", True), ("10.0.0.7", "10.0.0.7", True), ("::ffff:10.0.0.7", "10.0.0.7", True),
    ("10.0.0.8", "10.0.0.7", False), ("127.0.0.1", "10.0.0.7", False), ("fe80::1", "10.0.0.7", False),
    ("not an address", "10.0.0.7", False), ("", "10.0.0.7", False)])
def test_the_peer_check(peer, allowed, ok):
    assert peer_allowed(peer, allowed) is ok


def test_the_link_binds_loopback_beside_the_driver_and_the_node_ip_otherwise():
    assert link_hosts("10.0.0.7", "10.0.0.7") == ("127.0.0.1", "127.0.0.1")
    assert link_hosts("10.0.0.7", "10.0.0.9") == ("10.0.0.7", "10.0.0.9")
    with pytest.raises(ValueError, match="driver_ip"):
        link_hosts("10.0.0.7", "10.0.0.7; rm")


def test_a_connection_from_another_address_is_refused():
    worker = Worker()
    server = LinkServer(worker, "127.0.0.1", "127.0.0.2")     # the driver is 127.0.0.2
    try:
        stranger = socket.create_connection(server.address)   # from 127.0.0.1
        assert read_until_closed(stranger) == b""             # closed before a word: no nonce either
        with pytest.raises(LinkRefused):
            Link(server.address, server.token)                # the token does not help from there
        link = Link(server.address, server.token, source="127.0.0.2")
        assert link.send("echo", b"x", 1).result() == (b"x!", None)
        assert worker.seen == [1]
        link.close()
    finally:
        server.close()


def test_a_worker_actor_opens_its_link_for_its_driver_only(monkeypatch):
    import ray

    from specray.scheduler.messages import Proposals, decode

    class Actor(WorkerActor):
        def _call(self, op, data, arg, tensors=()):
            return Proposals(step_id=arg), None

    monkeypatch.setattr(ray.util, "get_node_ip_address", lambda: "127.0.0.1")
    actor = Actor()
    address, token = actor.open_link("127.0.0.1")             # the driver on this node: loopback
    assert address[0] == "127.0.0.1" and actor._link.peer == "127.0.0.1"
    assert actor.open_link("127.0.0.1") == (address, token)   # opened once
    link = Link(address, token)
    assert decode(link.send("propose", None, 5).result()[0], Proposals).step_id == 5
    # A driver on another node: bound to this node's IP, open to that driver only.
    address2, token2 = actor.open_link("127.0.0.2")
    assert actor._link.peer == "127.0.0.2" and address2 != address
    with pytest.raises(LinkLost):                             # the old server closed its connections
        link.send("propose", None, 6).result()
    with pytest.raises(LinkRefused):
        Link(address2, token2)
    assert decode(Link(address2, token2, source="127.0.0.2").send("propose", None, 7).result()[0],
                  Proposals).step_id == 7
    actor._link.close()


def test_at_most_two_connections(served):
    worker, server = served
    links = [Link(server.address, server.token) for _ in range(MAX_CONNECTIONS)]
    with pytest.raises(LinkRefused):
        Link(server.address, server.token)
    assert [link.send("echo", b"x", i).result() for i, link in enumerate(links)] == [(b"x!", None)] * 2
    links[0].close()
    deadline = time.monotonic() + 5            # the worker notices the close, then takes a new one
    while True:
        try:
            links[0] = Link(server.address, server.token)
            break
        except LinkRefused:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    assert links[0].send("echo", b"y", 9).result() == (b"y!", None)
    assert worker.seen == [0, 1, 9]
    for link in links:
        link.close()


def test_a_flood_changes_nothing_for_the_drivers_link(served):
    worker, server = served
    link = Link(server.address, server.token)
    assert link.send("echo", b"a", 0).result() == (b"a!", None)
    flood = [socket.create_connection(server.address) for _ in range(40)]     # silent: never a word
    noisy = [socket.create_connection(server.address) for _ in range(5)]
    for sock in noisy:
        sock.sendall(b"GET / HTTP/1.0\r\n\r\n" + secrets.token_bytes(200))
    assert [link.send("echo", b"b", i).result() for i in range(1, 20)] == [(b"b!", None)] * 19
    # Every stranger is closed: at once past the limit, after the handshake's deadline otherwise.
    t0 = time.monotonic()
    heard = [read_until_closed(sock) for sock in flood + noisy]
    assert time.monotonic() - t0 < HANDSHAKE_S * len(heard)
    assert all(h == b"" or h.startswith(HELLO) for h in heard)
    assert sum(h == b"" for h in heard) >= len(heard) - len(heard) // 2    # most never got a nonce
    assert link.send("echo", b"c", 99).result() == (b"c!", None)
    assert worker.seen == list(range(20)) + [99]
    second = Link(server.address, server.token)           # the driver reconnecting: a slot is free again
    assert second.send("echo", b"d", 100).result() == (b"d!", None)
    second.close()
    link.close()
    assert server._acceptor.is_alive()


# --- deadlines and keepalive ----------------------------------------------------------------

def test_a_silent_peer_is_dropped_at_the_handshake_deadline(served, caplog):
    _, server = served
    with caplog.at_level(logging.WARNING):
        silent = socket.create_connection(server.address)
        t0 = time.monotonic()
        assert read_until_closed(silent).startswith(HELLO)
        assert HANDSHAKE_S * 0.8 <= time.monotonic() - t0 < HANDSHAKE_S + 3
    assert "no handshake" in caplog.text


def test_the_drivers_end_has_connect_and_handshake_deadlines():
    full = socket.socket()
    full.bind(("127.0.0.1", 0))
    full.listen(0)                             # a worker that never accepts: its queue fills, SYNs drop
    queued = socket.create_connection(full.getsockname())
    t0 = time.monotonic()
    with pytest.raises(OSError):
        Link(full.getsockname(), b"t" * 32, connect_timeout_s=0.3)
    assert time.monotonic() - t0 < 3
    mute = socket.create_server(("127.0.0.1", 0))    # accepts, never says hello
    t0 = time.monotonic()
    with pytest.raises(LinkRefused):
        Link(mute.getsockname(), b"t" * 32, handshake_timeout_s=0.3)
    assert time.monotonic() - t0 < 3
    for sock in (queued, full, mute):
        sock.close()


def test_both_ends_keep_the_connection_alive(served):
    _, server = served
    link = Link(server.address, server.token)
    assert link.send("echo", b"x", 1).result() == (b"x!", None)        # the worker is past its handshake
    sock = link._sock
    assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
    if hasattr(socket, "TCP_KEEPIDLE"):
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == link_auth.KEEPIDLE_S
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT) == link_auth.KEEPCNT
    (conn,) = server._conns
    assert conn.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
    assert sock.gettimeout() is None and conn.gettimeout() is None        # calls block as long as a step
    link.close()


# --- bounded frames -------------------------------------------------------------------------

def frame(header) -> bytes:
    payload = msgpack.packb(header, use_bin_type=True)
    return struct.pack("<Q", len(payload)) + payload


BAD_CALLS = {
    "oversize frame": struct.pack("<Q", link_frames.MAX_FRAME_BYTES + 1),      # the length alone, no body
    "undecodable header": struct.pack("<Q", 3) + b"\xc1\xc1\xc1",
    "header not a list": frame(7),
    "header of three": frame(["echo", b"x", 1]),
    "op not a string": frame([1, b"x", 1, []]),
    "int64 tensor": frame(["echo", b"x", 1, [["int64", [2], 16]]]) + bytes(16),
    "unknown dtype": frame(["echo", b"x", 1, [["object", [2], 16]]]) + bytes(16),
    "shape and bytes disagree": frame(["echo", b"x", 1, [["float32", [2, 3], 20]]]) + bytes(20),
    "negative size": frame(["echo", b"x", 1, [["float32", [-1], 0]]]),
    "strides past any memory": frame(["echo", b"x", 1, [["float32", [0, 1 << 33, 1 << 33], 0]]]),
    "too many dims": frame(["echo", b"x", 1, [["float32", [1] * 9, 4]]]) + bytes(4),
    "tensor past the cap": frame(["echo", b"x", 1, [["float32", [1 << 32], 1 << 34]]]),
    "a map": frame(["echo", b"x", {"a": 1}, []]),
}


@pytest.mark.parametrize("what", list(BAD_CALLS))
def test_a_malformed_call_closes_that_connection_only(served, caplog, what):
    worker, server = served
    link = Link(server.address, server.token)
    with caplog.at_level(logging.WARNING):
        bad = authenticated(server)
        bad.sendall(BAD_CALLS[what])
        assert read_until_closed(bad) == b""          # closed at once: no reply, no wait for a body
    assert "malformed call" in caplog.text
    assert link.send("echo", b"x", 1).result() == (b"x!", None)
    assert worker.seen == [1]
    fresh = Link(server.address, server.token)
    assert fresh.send("echo", b"y", 2).result() == (b"y!", None)
    link.close()
    fresh.close()


def test_the_sender_holds_itself_to_the_same_bounds(served, monkeypatch):
    worker, server = served
    link = Link(server.address, server.token)
    with pytest.raises(ValueError, match="int64"):
        link.send("echo", b"x", 1, tensors=[torch.zeros(2, dtype=torch.int64)])
    monkeypatch.setattr(link_frames, "MAX_TENSOR_BYTES", 1024)
    with pytest.raises(ValueError, match="1024"):
        link.send("echo", b"x", 2, tensors=[torch.zeros(300)])        # 1200 bytes
    with pytest.raises(ValueError, match="1024"):
        link.send("echo", b"x", 3, tensors=[torch.zeros(200), torch.zeros(200)])   # 1600 together
    monkeypatch.setattr(link_frames, "MAX_FRAME_BYTES", 4096)
    with pytest.raises(ValueError, match="4096"):
        link.send("echo", bytes(5000), 4)
    assert link.send("echo", b"x", 5, tensors=[torch.zeros(200)]).result() == (b"x!", None)   # nothing was sent
    assert worker.seen == [5]
    # The worker holds a tensor past the cap to the same bound: the call is refused.
    raw = authenticated(server)
    raw.sendall(frame(["echo", b"x", 6, [["float32", [300], 1200]]]) + bytes(1200))
    assert read_until_closed(raw) == b""
    link.close()


def test_a_reply_outside_the_bounds_fails_that_call_only(served):
    _, server = served
    link = Link(server.address, server.token)
    bad = link.send("tensor", b"p", ("int64", [2, 2]))
    with pytest.raises(LinkCallError, match="int64"):
        bad.result()
    assert link.send("echo", b"x", 1).result() == (b"x!", None)
    link.close()


# --- the accept loop ------------------------------------------------------------------------

class FlakyListener:
    """The server's listening socket, failing its next accepts with ``errors`` first."""

    def __init__(self, sock: socket.socket, errors: list[int]) -> None:
        self.sock, self.errors = sock, list(errors)

    def accept(self):
        if self.errors:
            e = self.errors.pop(0)
            raise OSError(e, errno.errorcode[e])
        return self.sock.accept()

    def __getattr__(self, name):
        return getattr(self.sock, name)


def test_the_accept_loop_survives_errors_and_ends_with_the_server(served, caplog):
    _, server = served
    server._sock = FlakyListener(server._sock, [errno.EMFILE, errno.ECONNABORTED, errno.ENFILE, errno.EMFILE])
    with caplog.at_level(logging.WARNING):
        first = Link(server.address, server.token)        # taken by the accept already waiting
        second = Link(server.address, server.token)       # taken after four failures and pauses
    assert "accepting a connection failed" in caplog.text and "EMFILE" in caplog.text
    assert server._sock.errors == []
    assert first.send("echo", b"a", 1).result() == (b"a!", None)
    assert second.send("echo", b"b", 2).result() == (b"b!", None)
    server.close()
    server._acceptor.join(5)
    assert not server._acceptor.is_alive()
    with pytest.raises(LinkLost):                          # the server's connections end with it
        first.send("echo", b"c", 3).result()


# --- Ray with TLS ---------------------------------------------------------------------------

@pytest.mark.parametrize("value,on", [("1", True), ("true", True), ("TRUE", True), ("0", False), ("", False)])
def test_links_are_off_when_ray_runs_with_tls(monkeypatch, caplog, value, on):
    from specray.runtime.transport import actor_handle
    from specray.runtime.transport.draft_actor import DraftHandle
    from specray.runtime.transport.target_actor import TargetHandle

    class NoActor:
        """Any call to the actor fails the test: with TLS no link is asked for."""

        def __getattr__(self, name):
            raise AssertionError(f"the actor was asked for {name}")

    monkeypatch.setenv("RAY_USE_TLS", value)
    monkeypatch.setattr(actor_handle, "_tls_said", False)
    with caplog.at_level(logging.INFO, logger="specray.runtime.transport.actor_handle"):
        handles = [DraftHandle(NoActor(), 0, link=True), TargetHandle(NoActor(), 0, link=True)]
    assert [h._link_wanted for h in handles] == [not on] * 2
    if on:
        assert [h._linked() for h in handles] == [None, None]
    assert caplog.text.count("worker links are off") == (1 if on else 0)      # said once
