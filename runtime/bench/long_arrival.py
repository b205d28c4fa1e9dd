"""What chunked prefill is for: ``streams`` requests decode, and a long prompt arrives
among them. Fed whole, its prefill is one long step that every stream waits through (a
spike in their inter-token latency); fed in chunks of what ``max_num_batched_tokens``
leaves, the streams keep their pace. Reported per budget: the streams' inter-token
latency p50 and p99 over the run (and their ratio), and the long request's time to first
token (``benchmarks/serve_load.py --prompts long``)."""

from __future__ import annotations

import threading
import time

from specray.runtime.bench.chat import pct


def long_prompt(tokenizer, num_tokens: int) -> list[int]:
    from specray.runtime.bench.prompts import PARAGRAPHS
    from specray.workers.model_loader import encode_prompt

    text = ""
    while len(encode_prompt(tokenizer, text)) < num_tokens:
        text += " ".join(PARAGRAPHS) + "\n"
    return encode_prompt(tokenizer, text)[:num_tokens]


def run_long_arrival(rt, tokenizer, streams: int, stream_tokens: int, prompt_tokens: int,
                     arrive_after_s: float) -> dict:
    """``streams`` greedy streams of ``stream_tokens`` tokens; ``arrive_after_s`` after
    they start, one request with a ``prompt_tokens``-token prompt. Every call's requests
    carry a ``cache_salt`` of their own, so a repeat prefills the long prompt again instead
    of finding it in the prefix cache."""
    import uuid

    from specray import SamplingParams

    salt = uuid.uuid4().hex
    params = SamplingParams(max_tokens=stream_tokens, temperature=0.0, ignore_eos=True, cache_salt=salt)
    gaps: list[float] = []          # per token: a delta's wait shared by its tokens
    stalls: list[float] = []        # per delta: how long a stream waited for its next tokens
    lock = threading.Lock()
    short = [tokenizer(f"Story {i}: once upon a time", add_special_tokens=False)["input_ids"] for i in range(streams)]

    def stream(prompt: list[int]) -> None:
        last, mine, waits = None, [], []
        for d in rt.stream(prompt, params):
            now = time.perf_counter()
            if d.token_ids:
                if last is not None:
                    mine += [(now - last) / len(d.token_ids)] * len(d.token_ids)
                    waits.append(now - last)
                last = now
        with lock:
            gaps.extend(mine)
            stalls.extend(waits)

    threads = [threading.Thread(target=stream, args=(p,)) for p in short]
    for th in threads:
        th.start()
    time.sleep(arrive_after_s)
    t0 = time.perf_counter()
    ttft = None
    for d in rt.stream(long_prompt(tokenizer, prompt_tokens), SamplingParams(max_tokens=8, temperature=0.0,
                                                                             ignore_eos=True, cache_salt=salt)):
        if d.token_ids and ttft is None:
            ttft = time.perf_counter() - t0
    for th in threads:
        th.join()
    p50, p99 = pct(gaps, 0.5), pct(gaps, 0.99)
    s50, s99 = pct(stalls, 0.5), pct(stalls, 0.99)
    return dict(itl_p50_ms=1e3 * p50, itl_p99_ms=1e3 * p99, itl_p99_over_p50=p99 / p50 if p50 else float("nan"),
                stall_p50_ms=1e3 * s50, stall_p99_ms=1e3 * s99, stall_max_ms=1e3 * max(stalls, default=float("nan")),
                stall_p99_over_p50=s99 / s50 if s50 else float("nan"), long_ttft_ms=1e3 * (ttft or float("nan")))
