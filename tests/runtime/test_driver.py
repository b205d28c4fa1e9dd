"""DriverCore: its step loop outlives what goes wrong around it, and the options it wires."""

from __future__ import annotations

import pytest

from specray_testing import needs_adaptive, hf_greedy
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


def test_max_speculative_tokens_is_checked(llama_pair):
    t, d = llama_pair
    assert RuntimeConfig(target=t, draft=d, speculation_policy="adaptive").lookahead == 8
    assert RuntimeConfig(target=t, draft=d, speculation_policy="adaptive", max_speculative_tokens=6).lookahead == 6
    assert RuntimeConfig(target=t, draft=d).lookahead == 4
    with pytest.raises(ValueError, match="max_speculative_tokens applies to speculation_policy='adaptive'"):
        RuntimeConfig(target=t, draft=d, max_speculative_tokens=8)
    with pytest.raises(ValueError, match="max_speculative_tokens applies"):
        RuntimeConfig(target=t, draft=d, speculation_policy="adaptive", draft_early_stop=False,
                      max_speculative_tokens=8)
    with pytest.raises(ValueError, match="max_speculative_tokens 3 must be >= num_speculative_tokens 4"):
        RuntimeConfig(target=t, draft=d, speculation_policy="adaptive", max_speculative_tokens=3)
    with pytest.raises(ValueError, match="max_speculative_tokens must be an int >= 1"):
        RuntimeConfig(target=t, draft=d, speculation_policy="adaptive", max_speculative_tokens="8")


@needs_adaptive
def test_max_speculative_tokens_must_fit_the_window(llama_pair):
    t, d = llama_pair
    with pytest.raises(ValueError, match="max_speculative_tokens 64 must be below max_model_len 32"):
        DriverCore(RuntimeConfig(target=t, draft=d, speculation_policy="adaptive", max_speculative_tokens=64,
                                 max_model_len=32, device="cpu"), backend="local")


def test_draft_early_stop_must_be_a_bool(llama_pair):
    t, d = llama_pair
    with pytest.raises(ValueError, match="draft_early_stop must be True or False"):
        RuntimeConfig(target=t, draft=d, speculation_policy="adaptive", draft_early_stop=1)
