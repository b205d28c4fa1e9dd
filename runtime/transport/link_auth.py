"""Who may open a worker link (``worker_link``), and how each end proves itself.

The actor hands its link's token to the driver over an ordinary Ray call; the token never
crosses the link. Each connection opens with a challenge-response, both ways::

    worker -> driver   HELLO, Ns                      (a fresh 32-byte nonce)
    driver -> worker   Nc, HMAC(token, "driver" | Ns | Nc | worker addr | driver addr)
    worker -> driver   HMAC(token, "worker" | Ns | Nc | worker addr | driver addr)

The worker answers only a correct proof, and the driver uses the link only after checking
the worker's: a process that took over the port without the token learns nothing and
drives nothing. A proof is good for one connection (its nonces and both ends' addresses),
so one seen on the wire cannot be replayed. What follows the handshake is plaintext and
not authenticated frame by frame: the link is turned off where Ray runs with TLS.

Before any of that, a worker accepts connections only from the driver's address: loopback
when the driver is on the worker's node (the socket then binds 127.0.0.1), the driver's
node IP otherwise.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import secrets
import socket

import msgpack

from specray.runtime.transport.link_frames import recv_exact

HELLO = b"specray-link/2\n\0"
NONCE_BYTES = 32
PROOF_BYTES = 32
LOOPBACK = "127.0.0.1"
# A peer that vanished (its node lost, a cable pulled) is noticed after about
# KEEPIDLE + KEEPCNT * KEEPINTVL seconds without an answer to the kernel's probes.
KEEPIDLE_S, KEEPINTVL_S, KEEPCNT = 10, 5, 3


def link_hosts(own_ip: str, driver_ip: str) -> tuple[str, str]:
    """``(address to bind, the one peer address to accept)`` for a worker on ``own_ip`` whose
    driver is on ``driver_ip``: loopback for both when they are the same node."""
    if _ip(driver_ip) is None:
        raise ValueError(f"driver_ip must be an IP address, got {driver_ip!r:.80}")
    if _ip(driver_ip) == _ip(own_ip):
        return LOOPBACK, LOOPBACK
    return own_ip, driver_ip


def peer_allowed(peer_ip: str, allowed_ip: str) -> bool:
    """Whether a connection from ``peer_ip`` may proceed (an IPv4 address mapped into IPv6
    is the same address)."""
    got = _ip(peer_ip)
    return got is not None and got == _ip(allowed_ip)


def _ip(text: str):
    try:
        ip = ipaddress.ip_address(text)
    except ValueError:
        return None
    mapped = ip.ipv4_mapped if ip.version == 6 else None
    return mapped or ip


def proof(token: bytes, side: bytes, server_nonce: bytes, client_nonce: bytes, server_addr, client_addr) -> bytes:
    """HMAC-SHA256 of one end's part in one connection (``side``: b"driver" or b"worker")."""
    bound = msgpack.packb([side, server_nonce, client_nonce, list(server_addr[:2]), list(client_addr[:2])],
                          use_bin_type=True)
    return hmac.new(token, bound, hashlib.sha256).digest()


def challenge(sock: socket.socket, token: bytes) -> bool:
    """The worker's end: whether the peer proved it holds ``token`` (then it has the worker's
    proof too). Reads block for the socket's timeout."""
    server_nonce = secrets.token_bytes(NONCE_BYTES)
    sock.sendall(HELLO + server_nonce)
    got = bytearray(NONCE_BYTES + PROOF_BYTES)
    recv_exact(sock, got)
    client_nonce, client_proof = bytes(got[:NONCE_BYTES]), bytes(got[NONCE_BYTES:])
    here, there = sock.getsockname(), sock.getpeername()
    if not hmac.compare_digest(client_proof, proof(token, b"driver", server_nonce, client_nonce, here, there)):
        return False
    sock.sendall(proof(token, b"worker", server_nonce, client_nonce, here, there))
    return True


def answer(sock: socket.socket, token: bytes) -> None:
    """The driver's end: proves it holds ``token``, then checks the worker's proof;
    ``ConnectionError`` if the worker does not speak the link or holds another token."""
    hello = bytearray(len(HELLO) + NONCE_BYTES)
    recv_exact(sock, hello)
    if not hello.startswith(HELLO):
        raise ConnectionError("the peer does not speak the worker link")
    server_nonce, client_nonce = bytes(hello[len(HELLO):]), secrets.token_bytes(NONCE_BYTES)
    here, there = sock.getsockname(), sock.getpeername()
    sock.sendall(client_nonce + proof(token, b"driver", server_nonce, client_nonce, there, here))
    worker_proof = bytearray(PROOF_BYTES)
    recv_exact(sock, worker_proof)
    if not hmac.compare_digest(bytes(worker_proof), proof(token, b"worker", server_nonce, client_nonce, there, here)):
        raise ConnectionError("the worker did not prove it holds the link's token")


def keepalive(sock: socket.socket) -> None:
    """TCP keepalive with short timers where the platform has them (Linux; macOS names the
    idle time TCP_KEEPALIVE)."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    idle = getattr(socket, "TCP_KEEPIDLE", None) or getattr(socket, "TCP_KEEPALIVE", None)
    for opt, value in ((idle, KEEPIDLE_S), (getattr(socket, "TCP_KEEPINTVL", None), KEEPINTVL_S),
                       (getattr(socket, "TCP_KEEPCNT", None), KEEPCNT)):
        if opt is not None:
            sock.setsockopt(socket.IPPROTO_TCP, opt, value)
