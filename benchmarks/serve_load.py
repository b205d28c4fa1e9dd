"""Load through the HTTP endpoint against the Python handle, on the same requests.

For each concurrency C, C clients each send their next request when the last one ends
(closed loop); for each rate R (``--rates``), requests arrive at Poisson times, R a second
(open loop). All stream; the same requests at the same times go through HTTP (aiohttp,
SSE) and through ``SpecRuntime.stream`` (one thread a client), alternately,
``--repeats`` times. Reported as vLLM's
benchmark_serving reports: time to first token and inter-token latency (per token: a
chunk's gap divided by its tokens) p50/p99, output tokens/s, success rate; and the ratios
HTTP / handle.

``--workload json``: chat requests through HTTP with a JSON-schema ``response_format`` off
and on, side by side at each concurrency (SmolLM2 with n-gram proposals by default):
output tokens/s, their ratio on / off, acceptance, and the grammar's mask time per step
(``json_workload``)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import threading
import time


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def poisson_times(n: int, rate: float, seed: int = 0) -> list[float]:
    import random

    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(t)
    return out


async def http_level(url, model, prompts, conc, max_tokens, speculation, arrivals=None):
    """``conc`` closed-loop clients, or (``arrivals``) one request at each arrival time."""
    import aiohttp

    queue = list(range(len(prompts)))
    ttft, itl, ok, tokens = [], [], 0, 0

    async def worker(session, only=None):
        nonlocal ok, tokens
        while queue if only is None else only:
            i = queue.pop() if only is None else only.pop()
            body = {"model": model, "prompt": prompts[i], "max_tokens": max_tokens, "temperature": 0,
                    "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
            if not speculation:
                body["speculation"] = False
            t0 = time.perf_counter()
            last, first = t0, None
            async with session.post(url + "/v1/completions", json=body) as r:
                if r.status != 200:
                    continue
                async for raw in r.content:
                    line = raw.decode().strip()
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    ch = json.loads(line[6:])
                    now = time.perf_counter()
                    if ch["choices"] and ch["choices"][0]["text"]:
                        if first is None:
                            first = now
                            ttft.append(now - t0)
                        else:
                            n = max(1, len(ch["choices"][0]["text"]))     # byte-level tokenizer: chars = tokens
                            itl.extend([(now - last) / n] * n)
                        last = now
                    if ch.get("usage"):
                        tokens += ch["usage"]["completion_tokens"]
                        ok += 1

    t = time.perf_counter()
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600), connector=conn) as s:
        if arrivals is None:
            await asyncio.gather(*(worker(s) for _ in range(conc)))
        else:
            async def at(i):
                await asyncio.sleep(max(0.0, t + arrivals[i] - time.perf_counter()))
                await worker(s, [i])
            await asyncio.gather(*(at(i) for i in range(len(prompts))))
    return dict(wall=time.perf_counter() - t, ttft=ttft, itl=itl, ok=ok, tokens=tokens)


def handle_level(rt, prompts, conc, max_tokens, speculation, arrivals=None):
    from specray import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, speculation=speculation)
    queue = list(range(len(prompts)))
    lock = threading.Lock()
    ttft, itl, res = [], [], {"ok": 0, "tokens": 0}

    def worker(only=None):
        while True:
            with lock:
                if not (queue if only is None else only):
                    return
                i = queue.pop() if only is None else only.pop()
            if arrivals is not None:
                time.sleep(max(0.0, t + arrivals[i] - time.perf_counter()))
            t0 = time.perf_counter()
            last, first, n_tok = t0, None, 0
            for d in rt.stream(prompts[i], params):
                now = time.perf_counter()
                if d.token_ids:
                    if first is None:
                        first = now
                        ttft.append(now - t0)
                    else:
                        itl.extend([(now - last) / len(d.token_ids)] * len(d.token_ids))
                    last = now
                    n_tok += len(d.token_ids)
            with lock:
                res["ok"] += 1
                res["tokens"] += n_tok

    t = time.perf_counter()
    threads = ([threading.Thread(target=worker) for _ in range(conc)] if arrivals is None else
               [threading.Thread(target=worker, args=([i],)) for i in range(len(prompts))])
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return dict(wall=time.perf_counter() - t, ttft=ttft, itl=itl, **res)


def summary(r, n):
    return dict(tokens_per_s=r["tokens"] / r["wall"], ttft_p50_ms=1e3 * pct(r["ttft"], .5),
                ttft_p99_ms=1e3 * pct(r["ttft"], .99), itl_p50_ms=1e3 * pct(r["itl"], .5),
                itl_p99_ms=1e3 * pct(r["itl"], .99), success=r["ok"] / n)


async def json_level(url, model, asks, conc, max_tokens, schema):
    """``conc`` closed-loop clients sending the chat ``asks`` (non-streamed), with
    ``response_format`` json_schema ``schema`` (None: unconstrained)."""
    import aiohttp

    queue = list(range(len(asks)))
    tokens = ok = 0

    async def worker(session):
        nonlocal tokens, ok
        while queue:
            i = queue.pop()
            body = {"model": model, "messages": [{"role": "user", "content": asks[i]}], "max_tokens": max_tokens,
                    "temperature": 0.7, "seed": i}
            if schema is not None:
                body["response_format"] = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
            async with session.post(url + "/v1/chat/completions", json=body) as r:
                if r.status == 200:
                    ok += 1
                    tokens += (await r.json())["usage"]["completion_tokens"]

    t0 = time.perf_counter()
    async with aiohttp.ClientSession() as session:
        await asyncio.gather(*(worker(session) for _ in range(conc)))
    return dict(tokens=tokens, ok=ok, wall=time.perf_counter() - t0)


def json_workload(args) -> list[dict]:
    """Grammar off and on at each concurrency, alternating, ``args.repeats`` times."""
    import ray

    from specray import RuntimeConfig, SpecRuntime
    from specray.runtime import model_store
    from specray.runtime.bench.json_workload import ASKS, SCHEMA
    from specray.runtime.entrypoints.openai.ingress import start_http, stop_http

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    target = args.target or model_store.fetch("smollm2")
    rt = SpecRuntime(RuntimeConfig(target=target, draft=None, proposer=args.proposer, num_speculative_tokens=args.k,
                                   name="serve-load", namespace="serve-load"))
    url = start_http("serve-load", "serve-load", "m", port=18777)
    results = []
    try:
        asyncio.run(json_level(url, "m", ASKS, 2, 8, SCHEMA))          # warm-up
        for c in [int(x) for x in args.concurrency.split(",") if x]:
            n = args.num_requests or max(16, 2 * c)
            asks = [ASKS[i % len(ASKS)] + f" (request {i})" for i in range(n)]
            row = {"concurrency": c, "requests": n, "off": [], "on": []}
            for rep in range(args.repeats):
                for grammar in (("off", "on") if rep % 2 == 0 else ("on", "off")):
                    before = rt.metrics()
                    r = asyncio.run(json_level(url, "m", asks, c, args.max_tokens, SCHEMA if grammar == "on" else None))
                    after = rt.metrics()
                    d = {k: after[k] - before[k] for k in ("num_draft_tokens", "num_accepted_tokens", "mask_s",
                                                           "num_steps")}
                    row[grammar].append(dict(tokens_per_s=r["tokens"] / r["wall"], success=r["ok"] / n,
                                             acceptance=d["num_accepted_tokens"] / max(d["num_draft_tokens"], 1),
                                             mask_ms_per_step=1e3 * d["mask_s"] / max(d["num_steps"], 1)))
            med = {g: {m: statistics.median(x[m] for x in row[g]) for m in row[g][0]} for g in ("off", "on")}
            row["tokens_per_s_ratio_on_off"] = med["on"]["tokens_per_s"] / med["off"]["tokens_per_s"]
            results.append(row)
            print(f"json concurrency={c}: off {med['off']['tokens_per_s']:7.1f} tok/s accept "
                  f"{med['off']['acceptance']:.3f} | on {med['on']['tokens_per_s']:7.1f} tok/s accept "
                  f"{med['on']['acceptance']:.3f} mask {med['on']['mask_ms_per_step']:.3f} ms/step | ratio "
                  f"{row['tokens_per_s_ratio_on_off']:.3f} ok {med['on']['success']:.2f}", flush=True)
    finally:
        stop_http()
        rt.shutdown()
        ray.shutdown()
    return results


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--concurrency", default="1,8,32", help="closed-loop levels ('' for none)")
    ap.add_argument("--rates", default="", help="open-loop levels: Poisson arrivals, requests/s")
    ap.add_argument("--num-requests", type=int, default=0, help="per level (default: 16 or 2C, the larger)")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--speculation", default="on", help="on, off or on,off")
    ap.add_argument("-k", type=int, default=4)
    ap.add_argument("--out", default=None)
    ap.add_argument("--workload", default="text", choices=["text", "json"])
    ap.add_argument("--target", default=None, help="json workload: the model (default: SmolLM2, fetched)")
    ap.add_argument("--proposer", default="ngram", help="json workload: the proposer (a target alone: ngram, suffix)")
    args = ap.parse_args()
    if args.workload == "json":
        results = json_workload(args)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(dict(results=results, args=vars(args)), f, indent=1)
        return
    import ray
    from transformers import AutoTokenizer

    from specray import RuntimeConfig, SpecRuntime
    from specray.runtime.bench.prompts import bench_prompts
    from specray.runtime.entrypoints.openai.ingress import start_http, stop_http
    from specray.runtime.model_store import builtin_model

    load = [os.getloadavg()]
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    target = builtin_model("tiny-target")
    rt = SpecRuntime(RuntimeConfig(target=target, draft=builtin_model("tiny-draft"), num_speculative_tokens=args.k,
                                   name="serve-load", namespace="serve-load"))
    url = start_http("serve-load", "serve-load", "tiny", port=18777)
    tok = AutoTokenizer.from_pretrained(target)
    levels = [("concurrency", int(c)) for c in args.concurrency.split(",") if c] + \
        [("rate", float(r)) for r in args.rates.split(",") if r]
    results = []
    try:
        warm = [tok.decode(p) for p in bench_prompts("code", 8, tok)]
        asyncio.run(http_level(url, "tiny", warm, 4, 8, True))
        handle_level(rt, warm, 4, 8, True)
        for spec in [s == "on" for s in args.speculation.split(",")]:
            for mode, c in levels:
                n = args.num_requests or max(16, int(2 * c))
                arrivals = poisson_times(n, c) if mode == "rate" else None
                c = int(c) if mode == "concurrency" else c
                prompts = [tok.decode(p) for p in bench_prompts("code", n, tok)]
                runs = {"http": [], "handle": []}
                for rep in range(args.repeats):
                    order = ["http", "handle"] if rep % 2 == 0 else ["handle", "http"]
                    for kind in order:
                        if kind == "http":
                            r = asyncio.run(http_level(url, "tiny", prompts, c, args.max_tokens, spec, arrivals))
                        else:
                            r = handle_level(rt, prompts, c, args.max_tokens, spec, arrivals)
                        runs[kind].append(summary(r, n))
                ratio = [h["tokens_per_s"] / p["tokens_per_s"] for h, p in zip(runs["http"], runs["handle"])]
                dttft = [h["ttft_p50_ms"] - p["ttft_p50_ms"] for h, p in zip(runs["http"], runs["handle"])]
                row = dict(mode=mode, level=c, speculation=spec, requests=n, runs=runs, tokens_per_s_ratio=ratio,
                           ttft_p50_diff_ms=dttft)
                results.append(row)
                med = {k: {m: statistics.median(x[m] for x in v) for m in v[0]} for k, v in runs.items()}
                print(f"spec={'on' if spec else 'off'} {mode}={c:g}: http {med['http']['tokens_per_s']:7.1f} tok/s "
                      f"ttft {med['http']['ttft_p50_ms']:6.1f}/{med['http']['ttft_p99_ms']:6.1f} ms "
                      f"itl {med['http']['itl_p50_ms']:5.2f}/{med['http']['itl_p99_ms']:5.2f} ms "
                      f"ok {med['http']['success']:.2f} | handle {med['handle']['tokens_per_s']:7.1f} tok/s "
                      f"ttft {med['handle']['ttft_p50_ms']:6.1f}/{med['handle']['ttft_p99_ms']:6.1f} ms "
                      f"itl {med['handle']['itl_p50_ms']:5.2f} ms | ratio {statistics.median(ratio):.3f} "
                      f"({min(ratio):.3f}-{max(ratio):.3f}) dTTFT {statistics.median(dttft):+.1f} ms", flush=True)
    finally:
        stop_http()
        rt.shutdown()
        ray.shutdown()
    load.append(os.getloadavg())
    print("load", load)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(results=results, load=load, args=vars(args)), f, indent=1)


if __name__ == "__main__":
    main()
