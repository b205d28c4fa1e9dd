"""Load: a thousand concurrent requests against a KV pool that holds a small fraction of
them, through ``generate`` and ``stream`` (some streams read slowly). Everything
finishes with the plain greedy output, the pool preempts, and the driver forgets every
request once delivered. Admission control refuses a submit past ``max_pending``; one
offline ``generate`` call larger than that is fed in parts instead."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from specray_testing import hf_greedy

from specray import RuntimeConfig, SamplingParams, SpecRuntime
from specray.runtime.driver.core import DriverCore

NUM_PROMPTS = 40
LONGEST = 24
N_REQUESTS = 1000
N_STREAMS = 60
N_GENERATE_THREADS = 8


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(77)
    return [torch.randint(0, 97, (3 + i % 10,), generator=g).tolist() for i in range(NUM_PROMPTS)]


def request(i: int) -> tuple[int, int]:
    """(prompt index, max_tokens) of request i: mixed lengths, 2..LONGEST tokens."""
    return i % NUM_PROMPTS, 2 + (i * 7) % (LONGEST - 1)


@pytest.fixture(scope="module")
def reference(llama_pair):
    return hf_greedy(llama_pair[0], prompts(), LONGEST)


def test_a_thousand_concurrent_requests_all_finish_exactly(ray_session, llama_pair, reference):
    t, d = llama_pair
    ps = prompts()
    # 48 blocks of 4 tokens: room for about 6 of the longest requests at once, out of 1000.
    rt = SpecRuntime(RuntimeConfig(target=t, draft=d, num_speculative_tokens=3, block_size=4, num_kv_blocks=48,
                                   max_num_seqs=64, max_pending=N_REQUESTS, device="cpu", dtype="float32"))
    results: dict[int, list[int]] = {}
    errors: list[BaseException] = []
    lock = threading.Lock()

    def run_generate(ids: list[int]) -> None:
        try:
            outs = rt.generate([ps[request(i)[0]] for i in ids],
                               [SamplingParams(max_tokens=request(i)[1], temperature=0.0) for i in ids])
            with lock:
                results.update({i: o.token_ids for i, o in zip(ids, outs)})
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    def run_stream(i: int) -> None:
        try:
            got: list[int] = []
            p, n = request(i)
            for delta in rt.stream(ps[p], SamplingParams(max_tokens=n, temperature=0.0)):
                got += delta.token_ids
                if i % 3 == 0:
                    time.sleep(0.2)      # a slow reader: its tokens wait in the driver, bounded by max_tokens
            with lock:
                results[i] = got
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    streamed = list(range(N_STREAMS))
    rest = list(range(N_STREAMS, N_REQUESTS))
    threads = [threading.Thread(target=run_stream, args=(i,)) for i in streamed]
    threads += [threading.Thread(target=run_generate, args=(rest[j::N_GENERATE_THREADS],))
                for j in range(N_GENERATE_THREADS)]
    try:
        start = time.monotonic()
        for th in threads:
            th.start()
        for th in threads:
            th.join(timeout=240)
        elapsed = time.monotonic() - start
        assert not errors, errors[:3]
        assert not any(th.is_alive() for th in threads)
        assert sorted(results) == list(range(N_REQUESTS))
        wrong = [i for i in range(N_REQUESTS) if results[i] != reference[request(i)[0]][:request(i)[1]]]
        assert not wrong, f"{len(wrong)} requests differ from plain greedy decoding, e.g. {wrong[:5]}"
        m = rt.metrics()
        assert m["num_preemptions"] > 0              # the pool really was a fraction of the load
        assert m["num_requests_finished"] >= N_REQUESTS
        # Nothing held once delivered: no queue, no KV, no undelivered outputs.
        assert m["num_waiting"] == m["num_running"] == 0
        assert m["target_kv_blocks_used"] == [0] and m["draft_kv_blocks_used"] == [0]
        assert m["num_requests_held"] == 0
        # One offline call larger than max_pending is not refused: it is fed as room frees.
        outs = rt.generate([ps[0]] * (N_REQUESTS + 1), SamplingParams(max_tokens=2, temperature=0.0))
        assert [o.token_ids for o in outs] == [reference[0][:2]] * (N_REQUESTS + 1)
        assert rt.metrics()["num_requests_held"] == 0
        print(f"\n{N_REQUESTS} requests in {elapsed:.1f}s, {m['num_preemptions']} preemptions, "
              f"{m['num_emitted_tokens']} tokens")
    finally:
        rt.shutdown()


def test_pending_requests_count_until_they_finish(llama_pair):
    """With the step loop held, accepted requests stay pending: the next submit past the
    limit is refused; once they finish there is room again."""
    t, d = llama_pair
    core = DriverCore(RuntimeConfig(layout="colocated",
                                    target=t, draft=d, num_speculative_tokens=2, block_size=4, device="cpu",
                                    dtype="float32", max_pending=3), export_metrics=False)
    gate = threading.Event()
    real_step = core.engine.step

    def held_step():
        gate.wait()
        return real_step()
    core.engine.step = held_step
    try:
        params = SamplingParams(max_tokens=4, temperature=0.0)
        first = core.submit([[5, 6], [7, 8]], [params, params])
        assert first.error is None
        assert core.submit([[9]], [params]).error is None
        refused = core.submit([[10]], [params])
        assert refused.overloaded and refused.request_ids == []
        assert "3 requests pending, max_pending is 3" in refused.error
        gate.set()
        outs = core.wait(first.request_ids, timeout=60)
        assert outs is not None and [len(o.token_ids) for o in outs] == [4, 4]
        again = core.submit([[10]], [params])
        assert again.error is None and not again.overloaded
    finally:
        gate.set()
        core.shutdown()


def test_max_pending_is_validated(llama_pair):
    with pytest.raises(ValueError, match="max_pending"):
        RuntimeConfig(target=llama_pair[0], draft=llama_pair[1], max_pending=0)
