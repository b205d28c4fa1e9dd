"""gpu_check's conclusions: bf16 agreement figures, and which findings fail the check."""

from __future__ import annotations

import pytest

from specray.runtime.bench.gpu_report import agreement, failures, first_divergence, precision_report


def test_first_divergence():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert first_divergence([1, 2], [1, 2, 3]) == 2          # one ended early (an EOS)
    assert first_divergence([], []) is None


def test_agreement_counts_equal_positions_over_the_longer_output():
    a = agreement([[1, 2, 3, 4], [5, 6]], [[1, 2, 9, 4], [5, 6, 7]])
    assert a == {"exact": False, "equal_token_share": round(5 / 7, 4), "first_divergence": [2, 2]}
    assert agreement([[1]], [[1]]) == {"exact": True, "equal_token_share": 1.0, "first_divergence": [None]}
    with pytest.raises(ValueError, match="2 outputs against 1 references"):
        agreement([[1], [2]], [[1]])


def test_precision_report_puts_transformers_own_noise_beside_specray():
    ref1 = [[1, 2, 3, 4], [5, 6, 7, 8]]
    ref8 = [[1, 2, 3, 4], [5, 6, 0, 0]]            # transformers at batch 8 parts on prompt 1
    spec = [[1, 2, 3, 0], [5, 6, 7, 8]]
    r = precision_report(spec, ref1, ref8, 8)
    assert r["specray_vs_transformers"]["first_divergence"] == [3, None]
    assert r["transformers_batch8_vs_batch1"]["first_divergence"] == [None, 2]
    assert r["transformers_batch8_vs_batch1"]["equal_token_share"] == 0.75


def summary(device="cuda", **parts):
    base = {"exactness": {"status": "ok", "items": []}, "precision": {"status": "ok"},
            "forward": {"status": "ok", "failures": []}, "bench": {"status": "ok", "layouts": {}}}
    base.update(parts)
    return {"device": device, "parts": base}


def item(**kw):
    d = {"layout": "co-located", "proposer": "draft", "cuda_graphs": True, "exact": True,
         "graphs": {"graph_replays": 10, "eager_forwards": 3, "graph_capture_failures": 0}}
    d.update(kw)
    return d


def test_a_clean_run_has_no_failures():
    s = summary(exactness={"status": "ok", "items": [item(), item(layout="co-located eager", cuda_graphs=False,
                                                                 graphs={"graph_replays": 0})]},
                bench={"status": "ok", "layouts": {"actors": {"greedy_outputs_equal": True}}})
    assert failures(s) == []


def test_what_fails_the_check():
    s = summary(exactness={"status": "ok", "items": [
        item(exact=False), item(layout="actors", error="RuntimeError: placement"),
        item(proposer="ngram", graphs={"graph_replays": 0, "graph_capture_failures": 2}),
        item(proposer="none", graphs={"graph_replays": 0, "graph_capture_failures": 0})]},
        precision={"status": "timeout", "error": "past its 60 s budget"},
        forward={"status": "ok", "failures": ["batch 3 decode: graphs differ"]},
        bench={"status": "ok", "layouts": {"co-located": {"greedy_outputs_equal": False, "mismatches": ["x"]},
                                           "actors": {"error": "ValueError: no"}}})
    got = failures(s)
    assert got == ["precision: timeout (past its 60 s budget)",
                   "exactness co-located/draft: float32 output differs from transformers' generate",
                   "exactness actors/draft: RuntimeError: placement",
                   "exactness co-located/ngram: CUDA graph capture failed on 2 worker(s)",
                   "exactness co-located/none: no step replayed a CUDA graph",
                   "forward: batch 3 decode: graphs differ",
                   "bench co-located: greedy outputs differ: ['x']",
                   "bench actors: ValueError: no"]


def test_graph_counters_are_not_required_off_cuda():
    s = summary(device="cpu", exactness={"status": "ok", "items": [item(graphs={"graph_replays": 0})]})
    assert failures(s) == []


def test_the_tensor_parallel_section_fails_on_a_difference_and_passes_when_skipped():
    assert failures(summary(tensor_parallel={"status": "ok", "items": [],
                                             "skipped": "tensor parallel needs two GPUs, this machine has 1"})) == []
    s = summary(tensor_parallel={"status": "ok", "items": [{"proposer": "draft", "exact": False},
                                                          {"proposer": "ngram", "error": "RuntimeError: nccl"}]})
    assert failures(s) == ["tensor_parallel draft: float32 output at tensor_parallel_size=2 differs from "
                           "transformers' generate", "tensor_parallel ngram: RuntimeError: nccl"]
