"""``specray serve``: a detached, named driver on a running cluster, for
``SpecRuntime.connect(name=..., namespace=...)`` clients in other processes; with
``--http``, the driver and an OpenAI-compatible endpoint in the foreground
(``specray.runtime.entrypoints.openai.serve_http``)."""

from __future__ import annotations

import os
import sys
import time


def add_parser(sub) -> None:
    from specray.runtime.entrypoints.cli_args import add_model_args

    p = sub.add_parser("serve", help="start (or --stop) a detached specray driver on a Ray cluster")
    add_model_args(p)
    p.add_argument("--name", default="specray", help="actor name clients connect to")
    p.add_argument("--namespace", default="specray")
    p.add_argument("--stop", action="store_true", help="shut down the named driver and its workers")
    p.add_argument("--log-interval", type=float, default=0.0,
                   help="stay in the foreground and log a metrics line every N seconds; Ctrl-C stops the driver")
    from specray.runtime.entrypoints.openai import serve_http as http_serve

    http_serve.add_args(p)
    p.set_defaults(func=run)


def stop_driver(name: str, namespace: str) -> bool:
    """Shut down a named driver: its workers and placement group first, then the actor."""
    import ray

    try:
        driver = ray.get_actor(name, namespace=namespace)
    except ValueError:
        return False
    try:
        ray.get(driver.shutdown.remote(), timeout=60)
    finally:
        ray.kill(driver)
    return True


def summary_line(m: dict) -> str:
    return (f"running={m['num_running']} waiting={m['num_waiting']} finished={m['num_requests_finished']} "
            f"tokens/s={m['tokens_per_s']:.1f} acceptance={m['acceptance_rate']:.3f} "
            f"mean_len={m['mean_accepted_length']:.2f} preemptions={m['num_preemptions']}")


def run(args) -> int:
    if args.http:
        if args.stop:
            print("specray: --http serves in the foreground; stop it with Ctrl-C or SIGTERM", file=sys.stderr)
            return 2
        from specray.runtime.entrypoints.openai import serve_http as http_serve

        return http_serve.run(args)
    import ray

    from specray.runtime import ray_env
    from specray.runtime.client import SpecRuntime
    from specray.runtime.entrypoints.cli_args import runtime_config

    # A server outlives this process: it joins a running cluster, never a private one.
    address = args.ray_address or os.environ.get("RAY_ADDRESS") or "auto"
    ray_env.acquire(address, args.namespace, args.ray_connect_timeout_s)
    if args.stop:
        if not stop_driver(args.name, args.namespace):
            print(f"specray: no driver named {args.name!r} in namespace {args.namespace!r}", file=sys.stderr)
            return 1
        print(f"specray: stopped driver {args.name!r}")
        return 0
    args.ray_address = address
    cfg = runtime_config(args, name=args.name, namespace=args.namespace, detached=True)
    try:
        ray.get_actor(args.name, namespace=args.namespace)
        print(f"specray: a driver named {args.name!r} is already running in namespace {args.namespace!r}",
              file=sys.stderr)
        return 1
    except ValueError:
        pass
    rt = SpecRuntime(cfg)
    spec = cfg.speculation
    print(f"specray: driver {args.name!r} (namespace {args.namespace!r}) serving {cfg.model.target} "
          f"with proposer={spec.proposer} num_speculative_tokens={spec.num_speculative_tokens} on {address}")
    print(f"specray: attach with SpecRuntime.connect(name={args.name!r}, namespace={args.namespace!r})",
          flush=True)
    if args.log_interval <= 0:
        return 0
    try:
        while True:
            time.sleep(args.log_interval)
            print("specray: " + summary_line(rt.metrics()), flush=True)
    except KeyboardInterrupt:
        stop_driver(args.name, args.namespace)
        print("specray: stopped", flush=True)
    return 0
