"""Start-up capture of every CUDA graph bucket, and the clean fallback when one fails.

No CUDA here: ``step_graphs.available`` is patched so the runner takes its graph path, and
``graph_capture.for_device`` hands it a capturer that records (and, told to, fails) the
captures. A recorded capture runs the forward on replay, as ``Uncaptured`` does, so the
served steps go through the same static buffers a CUDA graph reads and writes."""

from __future__ import annotations

import pytest
from specray_testing import hf_greedy, model_runner

from specray.runtime.config import RuntimeConfig
from specray.runtime.driver.core import DriverCore
from specray.scheduler.sampling_params import SamplingParams
from specray.workers import graph_capture, step_graphs

BLOCK = 4


class RecordingCapture:
    """Counts captures, running each forward once as a warm-up; the ``fail_at``-th raises
    as an invalidated capture does."""

    def __init__(self, fail_at: int | None = None, device_lost: bool = False) -> None:
        self.fail_at, self.device_lost = fail_at, device_lost
        self.calls = 0
        self.abandoned = 0
        self.captured = 0

    def capture(self, fn):
        self.calls += 1
        fn()                        # the warm-up a CUDA capture runs
        if self.calls == self.fail_at:
            raise RuntimeError("operation not permitted when stream is capturing")
        self.captured += 1
        return fn

    def abandon(self) -> None:
        self.abandoned += 1
        self.captured = 0
        if self.device_lost:
            raise RuntimeError("the device is unusable after a failed CUDA graph capture: illegal address")


@pytest.fixture
def capturers(monkeypatch):
    """``capturers(**kw)``: every runner built from now on gets a RecordingCapture(**kw);
    returns the list they land in."""
    made: list[RecordingCapture] = []

    def install(**kw):
        monkeypatch.setattr(step_graphs, "available", lambda device: True)

        def make(device):
            made.append(RecordingCapture(**kw))
            return made[-1]

        monkeypatch.setattr(graph_capture, "for_device", make)
        return made

    return install


def runner(path, **kw):
    return model_runner(path, block_size=BLOCK, num_kv_blocks=64, max_num_seqs=8, executor="native",
                        cuda_graph_query_lens=(1, 3), **kw)


def decode(r, plan_builder, prompt: list[int], n: int) -> list[int]:
    """Greedy tokens of one sequence: a prefill, then n - 1 single-token steps."""
    r.kv.apply(plan_builder([0], [0], [len(prompt)], prompt, [len(prompt)]))
    out = [int(r.forward([0], [0], [len(prompt)], r.to_device(prompt), r.to_device([len(prompt) - 1])).argmax())]
    done = len(prompt)
    while len(out) < n:
        r.kv.apply(plan_builder([0], [done], [1], out[-1:], [done + 1]))
        out.append(int(r.forward([0], [done], [1], r.to_device(out[-1:]), r.to_device([0])).argmax()))
        done += 1
    return out


def test_every_bucket_is_captured_at_start_up_largest_first(tiny_model, plan_builder, capturers):
    made = capturers()
    r = runner(tiny_model("llama", seed=50))
    g = r.graphs
    # Before any step: every bucket captured, by one capturer (one pool).
    assert len(made) == 1 and made[0].calls == len(g.buckets) == g.captured > 0
    assert g.buckets == sorted(g.buckets, reverse=True)
    assert g.buckets[0] == (max(g.batches), max(g.query_lens), max(g.widths))
    assert r.graph_stats()["graphs_captured"] == len(g.buckets)
    path = tiny_model("llama", seed=50)
    got = decode(r, plan_builder, [3, 4, 5], 8)
    assert got == hf_greedy(path, [[3, 4, 5]], 8)[0]
    # The prefill ran eagerly, every decode step through its bucket; no capture after start-up.
    stats = r.graph_stats()
    assert (stats["graph_replays"], stats["eager_forwards"]) == (7, 1)
    assert made[0].calls == len(g.buckets)


def test_a_failed_capture_leaves_a_clean_eager_runner(tiny_model, plan_builder, capturers):
    made = capturers(fail_at=3)
    path = tiny_model("llama", seed=51)
    r = runner(path)
    assert r.graphs is None and made[0].abandoned == 1
    assert "stream is capturing" in r.graph_failure
    got = decode(r, plan_builder, [7, 8], 6)
    assert got == hf_greedy(path, [[7, 8]], 6)[0]
    stats = r.graph_stats()
    assert stats["graphs_captured"] == stats["graph_replays"] == 0 and stats["eager_forwards"] == 6
    assert "stream is capturing" in stats["graph_capture_failure"]


def test_a_device_lost_in_capture_refuses_to_start(tiny_model, capturers):
    capturers(fail_at=1, device_lost=True)
    with pytest.raises(RuntimeError, match="unusable after a failed CUDA graph capture"):
        runner(tiny_model("llama", seed=52))


def test_graph_counters_reach_metrics(llama_pair, capturers):
    t, d = llama_pair
    prompts = [[5, 6, 7], [8, 9, 10, 11]]
    for fail_at, replayed in ((None, True), (1, False)):
        capturers(fail_at=fail_at)
        drv = DriverCore(RuntimeConfig(layout="colocated",
                                       target=t, draft=d, num_speculative_tokens=3, block_size=4, device="cpu",
                                       dtype="float32", max_num_seqs=4))
        try:
            out = drv.wait(drv.submit(prompts, [SamplingParams(max_tokens=12, temperature=0.0)] * 2).request_ids,
                           timeout=120)
            m = drv.metrics()
        finally:
            drv.shutdown()
        assert [o.token_ids for o in out] == hf_greedy(t, prompts, 12)
        assert [w["kind"] for w in m["worker_graphs"]] == ["target", "draft"]
        assert m["graph_replays"] == sum(w["graph_replays"] for w in m["worker_graphs"])
        assert m["eager_forwards"] == sum(w["eager_forwards"] for w in m["worker_graphs"]) > 0
        if replayed:
            assert m["graph_capture_failures"] == 0
            assert all(w["graph_replays"] > 0 and w["graphs_captured"] > 0 for w in m["worker_graphs"])
        else:
            assert m["graph_capture_failures"] == 2 and m["graph_replays"] == 0


def test_profile_and_capture_write_no_block_a_sequence_owns(tiny_model, capturers):
    """The reserve profile's forwards (a full prefill budget, every sequence verifying at
    full length, the largest bucket) run on any device (off CUDA they measure nothing); the
    captures' warm-ups wrote the scratch block only."""
    capturers()
    r = runner(tiny_model("llama", seed=53))
    assert r.profile_reserve() == (0, 0)
    assert r.need.reserve == 0 and r.need.held == 0
    per_block = sum(t.numel() * t.element_size() for layer in r.kv.layers for t in layer) // (r.num_blocks + 1)
    assert r.need.per_block == per_block
    owned = slice(0, BLOCK * r.num_blocks)
    for k, v in r.kv.layers:
        assert not k[owned].any() and not v[owned].any()
    assert r.kv.layers[0][0][BLOCK * r.num_blocks:].any()      # the scratch block was written
