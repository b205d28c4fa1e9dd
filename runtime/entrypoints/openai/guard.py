"""The HTTP server's doors: what a request must show before the ingress reads it, and
the bounded read of its body.

In the order the ingress checks them:

- ``Host``: one of the allowed names (``--allowed-hosts``), so a web page that rebinds
  its own DNS name to 127.0.0.1 cannot read the answers (400 otherwise). An entry
  ``name`` admits ``name`` alone or with the bound port; ``name:port`` that port only;
  ``*`` admits any Host.
- ``Authorization: Bearer KEY`` on ``/v1/*`` when the server has an API key (401
  otherwise), compared in constant time.
- ``Content-Type: application/json`` on POST routes (415 otherwise): a page's "simple"
  ``text/plain`` form post, which browsers send cross-origin without asking, is refused.
- A body of at most ``max_body_bytes``, counted as it streams in, whatever
  ``Content-Length`` says (413 otherwise).

Each refusal is an ``ApiError`` in OpenAI's body. ``/health`` passes every door: it says
nothing but whether the driver answers.
"""

from __future__ import annotations

import hmac
import re
import socket
from dataclasses import dataclass

from specray.runtime.entrypoints.openai.protocol import ApiError

DEFAULT_MAX_BODY_BYTES = 4 * 2**20
API_KEY_ENV = "SPECRAY_API_KEY"
LOCAL_HOSTS = ("localhost", "127.0.0.1", "[::1]")
WILDCARD_BINDS = ("0.0.0.0", "::", "[::]", "")
_NAME = re.compile(r"[a-z0-9._-]+|\[[0-9a-z:.%]+\]")      # a DNS name or IPv4, or [IPv6]


class Secret:
    """A string that does not show itself: its repr and str hide it, so a log line or an
    error that prints the ingress's arguments does not print the key."""

    __slots__ = ("value",)

    def __init__(self, value: str) -> None:
        self.value = value

    def __repr__(self) -> str:
        return "Secret('***')"

    __str__ = __repr__

    def __reduce__(self):           # pickled into the deployment's arguments whole
        return (Secret, (self.value,))


def _split(host: str) -> tuple[str, str | None]:
    """``name[:port]`` as (name, port): IPv6 addresses in brackets, names lowercased and
    without a trailing dot, as browsers may send them."""
    host = host.strip().lower()
    if host.startswith("["):
        end = host.find("]")
        if end < 0:
            return host, None
        name, rest = host[:end + 1], host[end + 1:]
        return name, rest[1:] if rest.startswith(":") else None
    if host.count(":") > 1:                     # a bare IPv6 address (only in entries)
        return f"[{host}]", None
    name, sep, port = host.partition(":")
    return name.rstrip("."), port if sep else None


def host_set(entries: list[str] | tuple[str, ...], port: int) -> frozenset[str] | None:
    """The Host values ``entries`` admit on a server bound to ``port``; None (any Host)
    when an entry is ``*``."""
    out = set()
    for entry in entries:
        entry = entry.strip()
        if not entry:
            continue
        if entry == "*":
            return None
        name, p = _split(entry)
        if not _NAME.fullmatch(name) or (p is not None and not p.isdigit()):
            raise ValueError(f"allowed_hosts entry {entry!r} is not a host name or address with an optional :port")
        out.update([f"{name}:{p}"] if p is not None else [name, f"{name}:{port}"])
    if not out:
        raise ValueError("allowed_hosts is empty: name at least one host, or '*' for any")
    return frozenset(out)


def default_hosts(bind: str) -> list[str]:
    """The names a server bound to ``bind`` answers to by default: the bound address and
    the loopback names; bound to every interface, also this machine's name and addresses
    (the names clients use for it; others, as a load balancer's, need ``--allowed-hosts``)."""
    names = [bind, *LOCAL_HOSTS] if bind not in WILDCARD_BINDS else list(LOCAL_HOSTS)
    if bind in WILDCARD_BINDS:
        hostname = socket.gethostname()
        names += [hostname, socket.getfqdn()]
        try:
            names += socket.gethostbyname_ex(hostname)[2]
        except OSError:
            pass
    return list(dict.fromkeys(names))


@dataclass(frozen=True)
class Doors:
    """What the ingress asks of each request (see the module docstring); given to each
    replica as a deployment argument."""

    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    allowed_hosts: frozenset[str] | None = None      # Host values admitted; None: any
    api_key: Secret | None = None

    def __post_init__(self) -> None:
        if isinstance(self.max_body_bytes, bool) or not isinstance(self.max_body_bytes, int) \
                or self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be a positive integer, got {self.max_body_bytes!r}")
        if self.api_key is not None and (not isinstance(self.api_key, Secret) or not self.api_key.value):
            raise ValueError("api_key must be a non-empty Secret")

    @classmethod
    def build(cls, bind: str, port: int, allowed_hosts: list[str] | None = None, api_key: str | None = None,
              max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> Doors:
        """From the server's flags: ``allowed_hosts`` None means ``default_hosts(bind)``."""
        hosts = host_set(default_hosts(bind) if allowed_hosts is None else allowed_hosts, port)
        return cls(max_body_bytes, hosts, Secret(api_key) if api_key else None)

    def check_host(self, host: str | None) -> None:
        if self.allowed_hosts is None:
            return
        name, port = _split(host or "")
        if (f"{name}:{port}" if port is not None else name) not in self.allowed_hosts:
            raise ApiError(400, "the Host header names a host this server does not answer to; the server's "
                                "--allowed-hosts lists those it does", code="host_not_allowed")

    def check_key(self, authorization: str | None) -> None:
        if self.api_key is None:
            return
        scheme, _, given = (authorization or "").strip().partition(" ")
        # Compared even when the scheme is wrong, so the time taken says nothing either way.
        ok = hmac.compare_digest(given.strip().encode(), self.api_key.value.encode())
        if not (ok and scheme.lower() == "bearer"):
            raise ApiError(401, "a valid API key is required: send it as 'Authorization: Bearer <key>'",
                           code="invalid_api_key")

    @staticmethod
    def check_json(content_type: str | None) -> None:
        media = (content_type or "").split(";", 1)[0].strip().lower()
        if media != "application/json":
            raise ApiError(415, "the request body must be JSON, sent with 'Content-Type: application/json'",
                           code="unsupported_media_type")

    async def read_body(self, request) -> bytes:
        """The body of ``request`` (a Starlette ``Request``), read no further than the cap."""
        limit = self.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None:
            if not declared.strip().isdigit():
                raise ApiError(400, "the Content-Length header is not a number")
            if int(declared) > limit:
                raise _too_large(limit)
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise _too_large(limit)
            chunks.append(chunk)
        return b"".join(chunks)


def _too_large(limit: int) -> ApiError:
    return ApiError(413, f"the request body is larger than this server takes ({limit} bytes; --max-body-bytes)",
                    code="request_too_large")
