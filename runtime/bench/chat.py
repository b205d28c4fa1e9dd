"""The multi-turn chat workload (``specray bench --prompts chat``,
``benchmarks/serve_load.py --prompts chat``): what prefix caching is for.

Every conversation opens with one shared system prompt of about ``SYSTEM_TOKENS`` tokens
and runs 3 to 5 turns; each turn's prompt is the whole conversation so far (the system
prompt, every earlier question and answer, the new question), as chat clients send it.
``concurrency`` clients each hold one conversation at a time, sending its next turn when
the last answer is in (closed loop). Reported per setting: time to first token p50/p99
over all turns, output tokens/s over the run, acceptance, and the prefix cache's hit rate.
The conversation is carried as token ids (a turn's prompt is the previous prompt, its
answer's ids and the new question's), so every turn's prompt starts exactly with the
previous one's.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from specray.runtime.bench.prompts import INSTRUCTIONS, PARAGRAPHS

SYSTEM_TOKENS = 400

QUESTIONS = (
    "What is the main point of the second paragraph?",
    "Summarise the text above in one sentence.",
    "Which names appear in the text, and what does each person do?",
    "Rewrite your last answer for a child.",
    "List three facts from the text.",
    "What happens first, and what happens last?",
    "Give the text a short title.",
    "Which sentence is the longest?",
)


def system_prompt(tokenizer) -> list[int]:
    """About ``SYSTEM_TOKENS`` tokens of instructions and quoted paragraphs."""
    from specray.workers.model_loader import encode_prompt

    text, j = "You are a careful assistant. Answer from the reference texts below.\n\n", 0
    while len(encode_prompt(tokenizer, text)) < SYSTEM_TOKENS:
        text += f"{INSTRUCTIONS[j % len(INSTRUCTIONS)]}\n{PARAGRAPHS[j % len(PARAGRAPHS)]}\n\n"
        j += 1
    return encode_prompt(tokenizer, text)


def conversations(count: int, seed: int = 0) -> list[list[str]]:
    """``count`` conversations of 3 to 5 user turns each; each names its own case number,
    so two conversations share the system prompt and nothing after it."""
    rng = random.Random(seed)
    return [[f"(case {seed}-{c}) {rng.choice(QUESTIONS)}" for _ in range(rng.randint(3, 5))] for c in range(count)]


def question_ids(tokenizer, question: str) -> list[int]:
    # No special tokens: a turn is appended to the conversation, not a new document.
    return tokenizer(f"\nUser: {question}\nAssistant:", add_special_tokens=False)["input_ids"]


@dataclass
class ChatRun:
    ttft_s: list[float] = field(default_factory=list)     # one per turn
    itl_s: list[float] = field(default_factory=list)      # per token after the first of each turn
    tokens: int = 0
    turns: int = 0
    wall_s: float = 0.0

    def summary(self) -> dict:
        return dict(turns=self.turns, output_tokens=self.tokens, tokens_per_s=self.tokens / self.wall_s,
                    ttft_p50_ms=1e3 * pct(self.ttft_s, 0.5), ttft_p99_ms=1e3 * pct(self.ttft_s, 0.99),
                    itl_p50_ms=1e3 * pct(self.itl_s, 0.5), itl_p99_ms=1e3 * pct(self.itl_s, 0.99))


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


# A turn: prompt ids -> the answer's pieces as they arrive, each a list of token ids.
Send = Callable[[list[int]], "object"]


def run_chat(send: Send, tokenizer, convs: list[list[str]], concurrency: int) -> ChatRun:
    """Serve ``convs`` with ``concurrency`` closed-loop clients through ``send``."""
    system = system_prompt(tokenizer)
    queue = list(range(len(convs)))
    lock = threading.Lock()
    run = ChatRun()

    def client() -> None:
        while True:
            with lock:
                if not queue:
                    return
                c = queue.pop(0)
            prompt = list(system)
            for question in convs[c]:
                prompt = prompt + question_ids(tokenizer, question)
                t0 = last = time.perf_counter()
                answer: list[int] = []
                ttft, gaps = None, []
                for piece in send(prompt):
                    now = time.perf_counter()
                    if not piece:
                        continue
                    if ttft is None:
                        ttft = now - t0
                    else:
                        gaps += [(now - last) / len(piece)] * len(piece)
                    last = now
                    answer += piece
                with lock:
                    run.ttft_s.append(ttft if ttft is not None else time.perf_counter() - t0)
                    run.itl_s += gaps
                    run.tokens += len(answer)
                    run.turns += 1
                prompt = prompt + answer

    t = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(concurrency)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    run.wall_s = time.perf_counter() - t
    return run


def handle_sender(rt, max_tokens: int) -> Send:
    """Turns through ``SpecRuntime.stream`` (greedy, each answer ``max_tokens`` long)."""
    from specray import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)

    def send(prompt: list[int]):
        for delta in rt.stream(prompt, params):
            yield list(delta.token_ids)
    return send


def bench_chat(config, tokenizer, num_conversations: int, concurrency: int, max_tokens: int,
               repeats: int) -> dict:
    """The chat workload on ``config`` with prefix caching on and off, alternating per
    repeat (each setting its own runtime, started once): per setting, each repeat's
    summary with the runtime's acceptance and cache hit rate over that repeat."""
    from specray import SpecRuntime

    runtimes = {on: SpecRuntime(config.replace(enable_prefix_caching=on, max_num_seqs=max(concurrency, 1)))
                for on in (True, False)}
    out: dict[str, list[dict]] = {"caching_on": [], "caching_off": []}
    try:
        for rt in runtimes.values():          # warm-up: the first calls pay start-up costs
            run_chat(handle_sender(rt, 8), tokenizer, conversations(2, seed=99), 2)
        for rep in range(repeats):
            for on in ((True, False) if rep % 2 == 0 else (False, True)):
                rt = runtimes[on]
                before = rt.metrics()
                r = run_chat(handle_sender(rt, max_tokens), tokenizer, conversations(num_conversations, seed=rep),
                             concurrency)
                after = rt.metrics()
                d = {k: after[k] - before[k] for k in ("num_draft_tokens", "num_accepted_tokens",
                                                        "prefix_cache_queries", "prefix_cache_hits")}
                out["caching_on" if on else "caching_off"].append(dict(
                    r.summary(), acceptance_rate=d["num_accepted_tokens"] / max(d["num_draft_tokens"], 1),
                    prefix_cache_hit_rate=d["prefix_cache_hits"] / max(d["prefix_cache_queries"], 1)))
    finally:
        for rt in runtimes.values():
            rt.shutdown()
    return out
