"""Load through the HTTP endpoint against the Python handle, on the same requests.

For each concurrency C, C clients each send their next request when the last one ends
(closed loop); for each rate R (``--rates``), requests arrive at Poisson times, R a second
(open loop). All stream; the same requests at the same times go through HTTP (aiohttp,
SSE) and through ``SpecRuntime.stream`` (one thread a client), alternately,
``--repeats`` times. Reported as vLLM's
benchmark_serving reports: time to first token and inter-token latency (per token: a
chunk's gap divided by its tokens) p50/p99, output tokens/s, success rate; and the ratios
HTTP / handle.

``--prompts chat``: the multi-turn chat workload (``specray.runtime.bench.chat``: a
shared ~400-token system prompt, conversations of 3-5 turns, each turn's prompt the whole
conversation so far) at each concurrency, once on a runtime with prefix caching and once
on one without, through HTTP and the handle alternately; ``--target``/``--draft``/
``--proposer`` pick the models (default: the built-in pair with its draft), e.g.
``--target smollm2 --proposer ngram`` after ``specray models fetch smollm2``.

``--prompts long``: chunked prefill (``specray.runtime.bench.long_arrival``): 8 streams
decode and a ``--long-tokens`` prompt arrives among them, on a runtime whose step budget
is ``--chunk-budget`` tokens (chunked) and on one whose budget holds the whole prompt;
reported per runtime: the streams' inter-token latency p50/p99 and the long request's
TTFT, ``--repeats`` times (handle only).

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


def http_chat_sender(url: str, model: str, tokenizer, max_tokens: int):
    """Chat turns over HTTP (token-id prompts, streamed): each chunk's text as token ids."""
    import http.client
    from urllib.parse import urlparse

    u = urlparse(url)

    def send(prompt: list[int]):
        conn = http.client.HTTPConnection(u.hostname, u.port, timeout=600)
        body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                           "ignore_eos": True, "stream": True})
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        r = conn.getresponse()
        try:
            for raw in r:
                line = raw.decode().strip()
                if line.startswith("data: ") and line != "data: [DONE]":
                    ch = json.loads(line[6:])
                    if ch["choices"] and ch["choices"][0]["text"]:
                        yield tokenizer(ch["choices"][0]["text"], add_special_tokens=False)["input_ids"]
        finally:
            conn.close()
    return send


def chat_main(args, levels, tok, target, draft, proposer) -> list[dict]:
    """The chat workload with prefix caching on, then off, each on a runtime of its own."""
    from specray import RuntimeConfig, SpecRuntime
    from specray.runtime.bench.chat import conversations, handle_sender, run_chat
    from specray.runtime.entrypoints.openai.ingress import start_http, stop_http

    results = []
    for caching in (True, False):
        rt = SpecRuntime(RuntimeConfig(target=target, draft=draft, proposer=proposer, num_speculative_tokens=args.k,
                                       enable_prefix_caching=caching, name="serve-load", namespace="serve-load"))
        url = start_http("serve-load", "serve-load", "m", port=18777)
        try:
            run_chat(handle_sender(rt, 8), tok, conversations(2, seed=99), 2)          # warm-up
            for _, c in levels:
                c = int(c)
                n = args.num_requests or max(16, 2 * c)
                runs = {"http": [], "handle": []}
                for rep in range(args.repeats):
                    for kind in (["http", "handle"] if rep % 2 == 0 else ["handle", "http"]):
                        send = (http_chat_sender(url, "m", tok, args.max_tokens) if kind == "http"
                                else handle_sender(rt, args.max_tokens))
                        runs[kind].append(run_chat(send, tok, conversations(n, seed=rep), c).summary())
                med = {k: {m: statistics.median(x[m] for x in v) for m in v[0]} for k, v in runs.items()}
                results.append(dict(mode="chat", level=c, prefix_caching=caching, conversations=n, runs=runs))
                print(f"chat caching={'on' if caching else 'off'} concurrency={c}: " + " | ".join(
                    f"{k} {v['tokens_per_s']:7.1f} tok/s ttft {v['ttft_p50_ms']:6.1f}/{v['ttft_p99_ms']:6.1f} ms "
                    f"itl {v['itl_p50_ms']:5.2f}/{v['itl_p99_ms']:5.2f} ms" for k, v in med.items()), flush=True)
        finally:
            stop_http()
            rt.shutdown()
    return results


def long_main(args, tok, target, draft) -> list[dict]:
    """8 streams and a long prompt, on a chunked runtime and on one that prefills whole."""
    from specray import RuntimeConfig, SpecRuntime
    from specray.runtime.bench.long_arrival import run_long_arrival

    results = []
    for budget in (args.chunk_budget, max(8192, 2 * args.long_tokens)):
        rt = SpecRuntime(RuntimeConfig(target=target, draft=draft, proposer=args.proposer,
                                       num_speculative_tokens=args.k, max_num_batched_tokens=budget))
        try:
            # Warm-up over a prompt as long as the measured one: the first long chunk's
            # one-time costs (buffers sized to its context) would land in the first repeat.
            run_long_arrival(rt, tok, 2, 8, args.long_tokens, 0.0)
            runs = [run_long_arrival(rt, tok, 8, args.max_tokens, args.long_tokens, 0.5) for _ in range(args.repeats)]
        finally:
            rt.shutdown()
        med = {m: statistics.median(r[m] for r in runs) for m in runs[0]}
        results.append(dict(max_num_batched_tokens=budget, runs=runs))
        print(f"long prompt ({args.long_tokens} tokens) among 8 streams, max_num_batched_tokens={budget}: itl "
              f"{med['itl_p50_ms']:.2f}/{med['itl_p99_ms']:.2f} ms (p99/p50 {med['itl_p99_over_p50']:.2f}), "
              f"stalls {med['stall_p50_ms']:.1f}/{med['stall_p99_ms']:.1f} ms (p99/p50 "
              f"{med['stall_p99_over_p50']:.2f}, max {med['stall_max_ms']:.0f}), "
              f"long TTFT {med['long_ttft_ms']:.0f} ms", flush=True)
    return results


def write_results(args, results: list[dict], load: list | None = None) -> None:
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(results=results, load=load, args=vars(args)), f, indent=1)


def model_path(name: str) -> str:
    """A model directory, or the name of a model ``specray models fetch`` stored."""
    from specray.runtime import model_store

    if os.path.isdir(name):
        return name
    path = model_store.cached_path(name)
    if path is None:
        raise SystemExit(f"{name!r} is neither a directory nor a fetched model: specray models fetch {name}")
    return path


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
    ap.add_argument("--prompts", default="code", choices=["code", "chat", "long"],
                    help="text workload: code: held-out snippets, one request each; chat: multi-turn conversations "
                         "after a shared system prompt, with prefix caching on and off; long: a long prompt arriving "
                         "among decoding streams, with chunked prefill and without")
    ap.add_argument("--long-tokens", type=int, default=1500, help="--prompts long: the long prompt's tokens")
    ap.add_argument("--chunk-budget", type=int, default=256,
                    help="--prompts long: max_num_batched_tokens of the chunked runtime")
    ap.add_argument("--target", default=None, help="the model (a path or a fetched model's name; default: SmolLM2, "
                                                   "fetched, for the json workload, the built-in pair otherwise)")
    ap.add_argument("--draft", default=None, help="--prompts chat/long: default the built-in draft with the built-in "
                                                  "target")
    ap.add_argument("--proposer", default=None, help="default: ngram for the json workload and for a --target given "
                                                     "alone, the draft model for the built-in pair")
    args = ap.parse_args()
    if args.proposer is None:
        args.proposer = "draft" if args.workload == "text" and args.target is None else "ngram"
    if args.workload == "json":
        write_results(args, json_workload(args))
        return
    import ray
    from transformers import AutoTokenizer

    from specray import RuntimeConfig, SpecRuntime
    from specray.runtime.bench.prompts import bench_prompts
    from specray.runtime.entrypoints.openai.ingress import start_http, stop_http
    from specray.runtime.model_store import builtin_model

    load = [os.getloadavg()]
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    if args.prompts in ("long", "chat"):
        target = model_path(args.target) if args.target else builtin_model("tiny-target")
        draft = None if args.proposer not in ("draft", "draft+suffix") else (
            model_path(args.draft) if args.draft else builtin_model("tiny-draft"))
        tok = AutoTokenizer.from_pretrained(target)
        try:
            if args.prompts == "long":
                results = long_main(args, tok, target, draft)
            else:
                levels = [("concurrency", int(c)) for c in args.concurrency.split(",") if c]
                results = chat_main(args, levels, tok, target, draft, args.proposer)
        finally:
            ray.shutdown()
        load.append(os.getloadavg())
        print("load", load)
        write_results(args, results, load)
        return
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
    write_results(args, results, load)


if __name__ == "__main__":
    main()
