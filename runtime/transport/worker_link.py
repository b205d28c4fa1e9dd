"""A worker actor's own TCP socket: step calls without Ray's task path.

An actor call costs about 1 ms of submission, dispatch and reply on top of the work even
on one node (measured: 0.9-1.2 ms against 0.02-0.15 ms for the same exchange over a
socket between two actors), and at batch 1 nothing else runs while the driver waits for
the draft. So worker actors (the draft's, and targets past the one the driver's actor
hosts) also serve their step calls on a socket of their own (``LinkServer``), and the
driver's handle sends them there (``Link``):

- One connection carries calls in the order sent and replies in the same order, so a
  worker still applies its plans in the order the scheduler made them (two groups in
  flight have two calls outstanding; pre-drafts queue behind their window).
- Messages are the usual msgpack bytes; tensors (a call's draft probabilities for a
  target, a draft's reply) follow their header as raw bytes, read straight into the
  tensor's memory, within the bounds ``link_frames`` sets.
- Only the driver opens it: the socket binds loopback when the driver shares the worker's
  node, accepts only the driver's address, at most ``MAX_CONNECTIONS`` at a time, and
  each connection opens with a challenge-response on a token the actor handed out over an
  ordinary Ray call (``link_auth``). A connection that breaks any of this is closed and
  logged; the worker serves on.
- The actor dying closes the socket: the waiting call fails at once (``LinkLost``), the
  handle counts the death as a lost Ray call would, and opens a new link once Ray has
  restarted the actor. A node that vanishes is noticed by TCP keepalive. A worker that
  answers from an empty restart (``StaleCacheError``) is a lost worker, as on Ray calls;
  a link that cannot be opened (a firewall between nodes, a refused handshake) means Ray
  calls for good.
"""

from __future__ import annotations

import logging
import math
import secrets
import socket
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable

from specray.runtime.transport import link_auth
from specray.runtime.transport.link_frames import (
    LinkLost,
    LinkProtocolError,
    check_spec,
    check_specs,
    pack_frame,
    recv_frame,
    recv_tensor,
    send_tensors,
    spec,
    unpack_header,
)

__all__ = ["Link", "LinkCall", "LinkCallError", "LinkLost", "LinkRefused", "LinkServer"]

log = logging.getLogger(__name__)

OK, STALE, ERROR = 0, 1, 2
TOKEN_BYTES = 32
# The driver's link, and a reconnecting driver's new one while the old is still closing.
MAX_CONNECTIONS = 2
HANDSHAKE_TIMEOUT_S = 5.0
ACCEPT_BACKOFF_S = (0.01, 1.0)     # first and longest pause after a failed accept
WARN_EVERY_S = 10.0
MAX_ERROR_CHARS = 64 * 1024         # a worker's traceback sent to the driver, its tail


class LinkCallError(RuntimeError):
    """The worker raised while serving a call (bad input, a bug): the message is its traceback."""


class LinkRefused(ConnectionError):
    """The worker's link did not open: the worker closed the connection (another address's,
    or past its limit) or did not complete the handshake, or could not prove it holds the token."""


class LinkServer:
    """Serves ``handler(op, data, arg, tensors) -> (message bytes, host tensor or None)`` on a
    socket bound to ``host``, to connections from ``peer`` only, each connection's calls one
    after another in a thread of its own. The handler must be safe to call beside the
    actor's Ray methods (the caller takes a lock)."""

    def __init__(self, handler: Callable[[str, bytes | None, Any, list], tuple[bytes, Any]], host: str, peer: str,
                 handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S) -> None:
        self.handler = handler
        self.peer = peer
        self.token = secrets.token_bytes(TOKEN_BYTES)
        self.handshake_timeout_s = handshake_timeout_s
        self.closed = False
        self._lock = threading.Lock()
        self._conns: set[socket.socket] = set()
        self._warned: dict[str, tuple[float, int]] = {}
        self._sock = socket.create_server((host, 0))
        self.address = (host, self._sock.getsockname()[1])
        self._acceptor = threading.Thread(target=self._accept, name="specray-link-accept", daemon=True)
        self._acceptor.start()

    def _accept(self) -> None:
        """Returns only once the server is closed: a failed accept (out of file descriptors,
        a connection aborted before it was taken) is logged and tried again after a pause."""
        pause = ACCEPT_BACKOFF_S[0]
        while not self.closed:
            try:
                conn, addr = self._sock.accept()
                pause = ACCEPT_BACKOFF_S[0]
                self._admit(conn, addr[0])
            except Exception as e:   # noqa: BLE001 - whatever it was, the driver may connect again
                if self.closed:
                    return
                self._warn("accept", "worker link: accepting a connection failed (%s), again in %.2f s", e, pause)
                time.sleep(pause)
                pause = min(2 * pause, ACCEPT_BACKOFF_S[1])

    def _admit(self, conn: socket.socket, peer: str) -> None:
        """Closes at once, before reading anything, a connection from another address than
        the driver's or past ``MAX_CONNECTIONS``; serves the others in a thread each."""
        if not link_auth.peer_allowed(peer, self.peer):
            conn.close()
            self._warn("peer", "worker link: a connection from %s refused (only %s may connect)", peer, self.peer)
            return
        with self._lock:
            full = len(self._conns) >= MAX_CONNECTIONS
            if not full:
                self._conns.add(conn)
        if full:
            conn.close()
            self._warn("full", "worker link: a connection from %s refused (%d open already)", peer, MAX_CONNECTIONS)
            return
        try:
            threading.Thread(target=self._serve, args=(conn, peer), name="specray-link", daemon=True).start()
        except BaseException:
            self._drop(conn)
            raise

    def _serve(self, conn: socket.socket, peer: str) -> None:
        try:
            if self._handshake(conn, peer):
                while not self.closed:
                    op, data, arg, specs = self._read_call(conn)
                    self._answer(conn, op, data, arg, [recv_tensor(conn, s) for s in specs])
        except LinkProtocolError as e:
            self._warn("malformed", "worker link: a malformed call from %s, connection closed: %s", peer, e)
        except (OSError, LinkLost):
            pass            # the driver went away; a new one connects again
        except Exception:   # the connection ends, the worker serves on
            log.exception("worker link: serving %s failed, connection closed", peer)
        finally:
            self._drop(conn)

    def _handshake(self, conn: socket.socket, peer: str) -> bool:
        """Whether the peer proved it holds the token within the handshake's deadline; then
        reads block as long as the driver has no call."""
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        link_auth.keepalive(conn)       # a driver whose node vanished frees its connection
        conn.settimeout(self.handshake_timeout_s)
        try:
            proved = link_auth.challenge(conn, self.token)
        except TimeoutError:
            self._warn("timeout", "worker link: no handshake from %s within %.1f s, connection closed",
                       peer, self.handshake_timeout_s)
            return False
        if not proved:
            self._warn("proof", "worker link: a connection from %s without the token's proof, closed", peer)
            return False
        conn.settimeout(None)
        return True

    @staticmethod
    def _read_call(conn: socket.socket) -> tuple[str, bytes | None, Any, list]:
        header = unpack_header(recv_frame(conn))
        if not (len(header) == 4 and isinstance(header[0], str)
                and (header[1] is None or isinstance(header[1], bytes))):
            raise LinkProtocolError("a call's header must be [op, data bytes or nil, arg, tensor specs]")
        op, data, arg, specs = header
        return op, data, arg, check_specs(specs)

    def _answer(self, conn: socket.socket, op: str, data, arg, tensors: list) -> None:
        from specray.workers.errors import StaleCacheError

        tensor = None
        try:
            message, tensor = self.handler(op, data, arg, tensors)
            frame = pack_frame([OK, message] + (spec(tensor) if tensor is not None else []))
        except StaleCacheError as e:
            tensor, frame = None, pack_frame([STALE, str(e)[-MAX_ERROR_CHARS:]])
        except Exception as e:   # noqa: BLE001 - reported to the caller, the worker keeps serving
            tensor, frame = None, pack_frame([ERROR, "".join(traceback.format_exception(e))[-MAX_ERROR_CHARS:]])
        conn.sendall(frame)
        if tensor is not None:
            send_tensors(conn, [tensor])

    def _drop(self, conn: socket.socket) -> None:
        with self._lock:
            self._conns.discard(conn)
        conn.close()

    def _warn(self, kind: str, msg: str, *args) -> None:
        """``log.warning``, at most once per ``WARN_EVERY_S`` for each kind: a flood of
        refused connections must not flood the worker's log too."""
        now = time.monotonic()
        with self._lock:
            last, held = self._warned.get(kind, (-math.inf, 0))
            if now - last < WARN_EVERY_S:
                self._warned[kind] = (last, held + 1)
                return
            self._warned[kind] = (now, 0)
        if held:
            msg, args = msg + " (%d more like it not logged)", (*args, held)
        log.warning(msg, *args)

    def close(self) -> None:
        """Stops accepting and ends every connection (their threads close them)."""
        self.closed = True
        with self._lock:
            # shutdown, not close: it wakes the threads blocked on these sockets.
            for sock in (self._sock, *self._conns):
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
        self._sock.close()


@dataclass(frozen=True)
class LinkCall:
    """One call sent on ``link``: its place in the link's order."""

    link: "Link"
    index: int

    def result(self) -> tuple[bytes, Any]:
        return self.link.receive(self.index)


class Link:
    """The driver's end: ``send`` returns a ``LinkCall`` at once, ``LinkCall.result`` waits
    for its reply (replies to earlier calls read on the way are kept for their waiters)."""

    def __init__(self, address: tuple[str, int], token: bytes, source: str | None = None,
                 connect_timeout_s: float = 5.0, handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S) -> None:
        """Connects from ``source`` (an address of this node; None: the one routing picks) and
        runs the handshake. ``OSError`` where the worker cannot be reached within
        ``connect_timeout_s``; ``LinkRefused`` where the handshake does not complete within
        ``handshake_timeout_s``."""
        host, port = address
        self._sock = socket.create_connection((host, port), timeout=connect_timeout_s,
                                              source_address=(source, 0) if source else None)
        try:
            self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            link_auth.keepalive(self._sock)     # a worker whose node vanished fails the waiting call
            self._sock.settimeout(handshake_timeout_s)
            link_auth.answer(self._sock, token)
        except (OSError, LinkLost) as e:
            self._sock.close()
            raise LinkRefused(f"the worker link at {host}:{port} did not open: {e}") from None
        self._sock.settimeout(None)      # a step takes as long as it takes; a death closes the socket
        self._sent = 0
        self._read = 0
        self._early: dict[int, tuple[bytes, Any] | BaseException] = {}
        self.closed = False

    def send(self, op: str, data: bytes | None = None, arg: Any = None, tensors=()) -> LinkCall:
        """``tensors``: host tensors the worker's handler receives after ``arg``. A call
        outside the link's bounds (``link_frames``) raises ``LinkProtocolError`` and sends
        nothing; the link stays open."""
        if self.closed:
            raise LinkLost("the link is closed")
        frame = pack_frame([op, data, arg, check_specs([spec(t) for t in tensors])])
        try:
            self._sock.sendall(frame)
            send_tensors(self._sock, tensors)
        except OSError as e:
            self.close()
            raise LinkLost(f"sending to the worker failed: {e}") from None
        self._sent += 1
        return LinkCall(self, self._sent - 1)

    def receive(self, index: int) -> tuple[bytes, Any]:
        while index not in self._early:
            if self.closed or self._read >= self._sent:
                raise LinkLost("the link closed before this call's reply")
            try:
                self._early[self._read] = self._read_reply()
            except LinkCallError as e:
                self._early[self._read] = e
            except (OSError, LinkLost, LinkProtocolError) as e:
                self.close()
                raise LinkLost(str(e) or "the worker's link failed") from None
            self._read += 1
        got = self._early.pop(index)
        if isinstance(got, BaseException):
            raise got
        return got

    def _read_reply(self) -> tuple[bytes, Any]:
        head = unpack_header(recv_frame(self._sock))
        status = head[0] if head and type(head[0]) is int else None
        if not (len(head) in (2, 5) and status in (OK, STALE, ERROR)
                and isinstance(head[1], bytes if status == OK else str)):
            raise LinkProtocolError("a reply's header must be [status, message, *tensor spec]")
        tensor = recv_tensor(self._sock, check_spec(head[2:])) if len(head) == 5 else None
        if status == STALE:
            raise LinkLost(head[1])
        if status == ERROR:
            raise LinkCallError(head[1])
        return head[1], tensor

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            try:
                self._sock.close()
            except OSError:
                pass
