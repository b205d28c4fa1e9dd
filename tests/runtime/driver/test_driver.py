"""DriverCore: its step loop outlives what goes wrong around it, and the options it wires."""

from __future__ import annotations

import pytest

from specray_testing import hf_greedy
from specray.runtime.config import RuntimeConfig
from specray.runtime.driver.core import DriverCore
from specray.scheduler.sampling_params import SamplingParams


class BrokenExporter:
    """A metrics exporter that fails every update (as a metrics agent that went away
    would): before the fix, the step loop died with it and every request waited for ever."""

    def __init__(self) -> None:
        self.calls = 0

    def due(self) -> bool:
        return True

    def update(self, metrics: dict) -> None:
        self.calls += 1
        raise KeyError("num_predrafted_windows")


def test_a_failing_metrics_export_does_not_stop_serving(llama_pair):
    t, d = llama_pair
    drv = DriverCore(RuntimeConfig(target=t, draft=d, num_speculative_tokens=3, block_size=4, device="cpu",
                                   dtype="float32"), backend="local")
    drv._exporter = exporter = BrokenExporter()
    prompts = [[5, 6, 7], [8, 9, 10, 11]]
    try:
        first = drv.wait(drv.submit(prompts, [SamplingParams(max_tokens=12, temperature=0.0)] * 2).request_ids,
                         timeout=120)
        again = drv.wait(drv.submit(prompts[:1], [SamplingParams(max_tokens=5, temperature=0.0)]).request_ids,
                         timeout=120)
        status = drv.metrics()
    finally:
        drv.shutdown()
    assert [o.token_ids for o in first] == hf_greedy(t, prompts, 12)
    assert list(again[0].token_ids) == hf_greedy(t, prompts[:1], 5)[0]
    assert exporter.calls > 1
    assert "metrics export: KeyError" in status["last_error"]


def test_num_speculative_tokens_must_fit_the_window(llama_pair):
    t, d = llama_pair
    with pytest.raises(ValueError, match="num_speculative_tokens 40 must be below max_model_len 32"):
        DriverCore(RuntimeConfig(target=t, draft=d, num_speculative_tokens=40, max_model_len=32, device="cpu"),
                   backend="local")


def _local(llama_pair, **kw):
    t, d = llama_pair
    return DriverCore(RuntimeConfig(target=t, draft=d, num_speculative_tokens=3, block_size=4, device="cpu",
                                    dtype="float32", **kw), backend="local")


def test_abort_frees_blocks_before_the_next_step_and_others_decode_on(llama_pair):
    t, _ = llama_pair
    drv = _local(llama_pair)
    try:
        long, short = drv.submit([[5, 6, 7], [8, 9, 10]], [SamplingParams(max_tokens=25, temperature=0.0,
                                                                          ignore_eos=True)] * 2).request_ids
        assert drv.poll(long, timeout=60).token_ids            # running: it holds blocks
        assert drv.abort([long, "no-such-id"]) == [long]
        assert drv.abort([long]) == []                          # once only
        (out,) = drv.wait([short], timeout=120)
        m = drv.metrics()
    finally:
        drv.shutdown()
    assert out.token_ids == hf_greedy(t, [[8, 9, 10]], 25)[0]
    assert m["target_kv_blocks_used"] == [0] and m["num_running"] == 0 and m["num_requests_held"] == 0
    assert m["num_requests_aborted"] == 1
    with pytest.raises(ValueError, match="unknown request_id"):
        drv.poll(long)


def test_poll_many_returns_every_request_with_news_in_one_call(llama_pair):
    t, _ = llama_pair
    drv = _local(llama_pair)
    prompts = [[5, 6, 7], [8, 9, 10, 11], [12, 13]]
    try:
        ids = drv.submit(prompts, [SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)] * 3).request_ids
        got = {rid: [] for rid in ids}
        finished, polls = set(), 0
        assert drv.poll_many(["gone"], timeout=30).unknown == ["gone"]
        while len(finished) < 3:
            reply = drv.poll_many([r for r in ids if r not in finished], timeout=30)
            polls += 1
            assert not reply.unknown and not reply.errors
            for d in reply.deltas:
                got[d.request_id] += d.token_ids
                if d.finished:
                    finished.add(d.request_id)
    finally:
        drv.shutdown()
    assert [got[r] for r in ids] == hf_greedy(t, prompts, 10)
    assert polls < 30                                   # several requests' tokens per call
