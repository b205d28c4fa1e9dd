"""DriverCore: its step loop outlives what goes wrong around it, and the options it wires."""

from __future__ import annotations

import pytest

from specray_testing import hf_greedy
from specray.config import RuntimeConfig
from specray.driver import DriverCore
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
        raise KeyError("num_stopped_proposals")


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


@pytest.mark.parametrize("early_stop", [True, False])
def test_requests_alone_stop_their_drafts_early_and_stay_exact(llama_pair, early_stop):
    """``draft_early_stop`` (the default): a request alone in the batch gets a floor from
    the adaptive policy's cost model, the real draft worker stops there and reports its
    probabilities; outputs stay transformers' greedy ones. Off, nothing is reported."""
    t, d = llama_pair
    drv = DriverCore(RuntimeConfig(target=t, draft=d, num_speculative_tokens=4, block_size=4, device="cpu",
                                   dtype="float32", speculation_policy="adaptive", draft_early_stop=early_stop),
                     backend="local")
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6], [5, 3, 5, 8, 9, 7, 9]]
    params = SamplingParams(max_tokens=40, temperature=0.0)
    try:
        outs = [drv.wait(drv.submit([p], [params]).request_ids, timeout=300)[0] for p in prompts]
        policy = drv.scheduler.policy
        info, m = drv.info(), drv.metrics()
    finally:
        drv.shutdown()
    assert [o.token_ids for o in outs] == hf_greedy(t, prompts, 40)
    assert policy.stop_early is early_stop
    assert (policy.confidence.observations > 0) is early_stop
    # Alone with stops, a request may propose past num_speculative_tokens (twice it by
    # default; test_adaptive.py checks that it does).
    assert info["max_speculative_tokens"] == m["max_speculative_tokens"] == (8 if early_stop else 4)


def test_max_speculative_tokens_is_checked(llama_pair):
    t, d = llama_pair
    assert RuntimeConfig(target=t, draft=d, speculation_policy="adaptive").widest_k == 8
    assert RuntimeConfig(target=t, draft=d, speculation_policy="adaptive", max_speculative_tokens=6).widest_k == 6
    assert RuntimeConfig(target=t, draft=d).widest_k == 4
    with pytest.raises(ValueError, match="max_speculative_tokens applies to speculation_policy='adaptive'"):
        RuntimeConfig(target=t, draft=d, max_speculative_tokens=8)
    with pytest.raises(ValueError, match="max_speculative_tokens applies"):
        RuntimeConfig(target=t, draft=d, speculation_policy="adaptive", draft_early_stop=False,
                      max_speculative_tokens=8)
    with pytest.raises(ValueError, match="max_speculative_tokens 3 must be >= num_speculative_tokens 4"):
        RuntimeConfig(target=t, draft=d, speculation_policy="adaptive", max_speculative_tokens=3)
    with pytest.raises(ValueError, match="max_speculative_tokens must be an int >= 1"):
        RuntimeConfig(target=t, draft=d, speculation_policy="adaptive", max_speculative_tokens="8")
    with pytest.raises(ValueError, match="max_speculative_tokens 64 must be below max_model_len 32"):
        DriverCore(RuntimeConfig(target=t, draft=d, speculation_policy="adaptive", max_speculative_tokens=64,
                                 max_model_len=32, device="cpu"), backend="local")


def test_draft_early_stop_must_be_a_bool(llama_pair):
    t, d = llama_pair
    with pytest.raises(ValueError, match="draft_early_stop must be True or False"):
        RuntimeConfig(target=t, draft=d, speculation_policy="adaptive", draft_early_stop=1)
