"""``specray serve --http``: the driver and its OpenAI-compatible endpoint, in the
foreground until Ctrl-C or SIGTERM, which stop the endpoint, the driver and its workers.

With no ``--ray-address`` (and no ``RAY_ADDRESS``) it starts a private local Ray, as
``SpecRuntime`` does; on a cluster the ingress autoscales (``--http-replicas min,max``)
and the driver stays the one scheduling point. ``--api-key`` (or ``SPECRAY_API_KEY``),
``--allowed-hosts`` and ``--max-body-bytes`` set the server's doors
(``specray.runtime.entrypoints.openai.guard``).
"""

from __future__ import annotations

import os
import signal
import sys
import threading

from specray.runtime.entrypoints.openai.guard import API_KEY_ENV, DEFAULT_MAX_BODY_BYTES, Doors


def add_args(p) -> None:
    p.add_argument("--http", action="store_true",
                   help="serve OpenAI's HTTP API (/v1/completions, /v1/chat/completions) in the foreground")
    p.add_argument("--host", default="127.0.0.1", help="with --http: the address to listen on")
    p.add_argument("--port", type=int, default=8000, help="with --http: the port to listen on")
    p.add_argument("--served-model-name", default=None,
                   help="with --http: the model name clients ask for (default: the target directory's name)")
    p.add_argument("--http-replicas", default="1", type=replicas,
                   help="with --http: ingress replicas, N or MIN,MAX (autoscaled between them)")
    # No default shown or read here: the key is never printed, not even by --help.
    p.add_argument("--api-key", default=None,
                   help=f"with --http: /v1/* routes need 'Authorization: Bearer KEY' (default: ${API_KEY_ENV}, else "
                        "no key); /health stays open")
    p.add_argument("--allowed-hosts", default=None, type=host_list,
                   help="with --http: comma-separated Host header values the server answers to, each NAME (alone or "
                        "with the bound port) or NAME:PORT; '*' for any (default: the --host address, localhost, "
                        "127.0.0.1 and [::1]; bound to 0.0.0.0, also this machine's name and addresses)")
    p.add_argument("--max-body-bytes", default=DEFAULT_MAX_BODY_BYTES, type=positive_int,
                   help=f"with --http: the largest request body taken; larger ones are a 413 (default: "
                        f"{DEFAULT_MAX_BODY_BYTES})")


def host_list(text: str) -> list[str]:
    import argparse

    hosts = [h.strip() for h in text.split(",") if h.strip()]
    if not hosts:
        raise argparse.ArgumentTypeError("--allowed-hosts wants a comma-separated list of hosts, or '*'")
    return hosts


def positive_int(text: str) -> int:
    import argparse

    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"--max-body-bytes wants a positive integer, got {text!r}")
    return value


def doors(args, environ=os.environ) -> Doors:
    """The server's doors from its flags; the API key from ``--api-key``, else the
    environment (an empty value is no key)."""
    key = args.api_key if args.api_key is not None else environ.get(API_KEY_ENV) or None
    if key is not None and not key.strip():
        raise ValueError("--api-key is empty: give a key, or leave the flag out for none")
    return Doors.build(args.host, args.port, args.allowed_hosts, key, args.max_body_bytes)


def replicas(text: str) -> tuple[int, int]:
    import argparse

    try:
        parts = [int(x) for x in text.split(",")]
    except ValueError:
        parts = []
    if len(parts) == 1:
        parts *= 2
    if len(parts) != 2 or not 1 <= parts[0] <= parts[1]:
        raise argparse.ArgumentTypeError(f"--http-replicas wants N or MIN,MAX with 1 <= MIN <= MAX, got {text!r}")
    return parts[0], parts[1]


def served_name(target: str) -> str:
    """A local target is named by its directory; a hub id by itself, as vLLM names it."""
    if not os.path.isdir(target):
        return target
    return os.path.basename(os.path.normpath(target)) or target


def run(args) -> int:
    from specray.runtime.client import SpecRuntime
    from specray.runtime.entrypoints.cli_args import runtime_config
    from specray.runtime.entrypoints.openai.ingress import start_http, stop_http

    if not 0 < args.port < 65536:
        print(f"specray: --port must be in 1..65535, got {args.port}", file=sys.stderr)
        return 2
    gates = doors(args)
    cfg = runtime_config(args, name=args.name, namespace=args.namespace, detached=False)
    name = args.served_model_name or served_name(cfg.model.target)
    stop = threading.Event()
    rt = SpecRuntime(cfg)
    # After ray.init, which installs its own SIGTERM handler (it would end the process
    # with nothing stopped): SIGTERM now ends it as Ctrl-C does, through the cleanup below.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    served = False
    try:
        served = True
        url = start_http(args.name, args.namespace, name, args.host, args.port, args.http_replicas, doors=gates)
        spec = cfg.speculation
        print(f"specray: serving {name!r} ({cfg.model.target}, proposer={spec.proposer}, "
              f"num_speculative_tokens={spec.num_speculative_tokens}) at {url}/v1"
              f"{' (API key required)' if gates.api_key else ''}", flush=True)
        stop.wait()
        print("specray: stopping", flush=True)
    finally:
        try:
            if served:
                stop_http()
        finally:
            rt.shutdown()
    print("specray: stopped", flush=True)
    return 0
