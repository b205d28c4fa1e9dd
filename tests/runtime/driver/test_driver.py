"""DriverCore: its step loop outlives what goes wrong around it, and the options it wires."""

from __future__ import annotations

import pytest
from specray_testing import MARK, break_steps_of, hf_greedy

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
    drv = DriverCore(RuntimeConfig(layout="colocated",
                                   target=t, draft=d, num_speculative_tokens=3, block_size=4, device="cpu",
                                   dtype="float32"))
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
        DriverCore(RuntimeConfig(layout="colocated",
                                 target=t, draft=d, num_speculative_tokens=40, max_model_len=32, device="cpu"))


def _local(llama_pair, **kw):
    t, d = llama_pair
    return DriverCore(RuntimeConfig(layout="colocated",
                                    target=t, draft=d, num_speculative_tokens=3, block_size=4, device="cpu",
                                    dtype="float32", **kw))


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


# -- a failed step fails only the request that makes it fail ------------------------------

GOOD = [SamplingParams(max_tokens=20, temperature=0.9, top_k=20, seed=7),
        SamplingParams(max_tokens=20, temperature=0.8, seed=11, stop_token_ids=[3])]
PROMPTS = [[5, 6, 7], [8, 9, 10, 11]]


def stream(drv: DriverCore, ids: list[str]) -> tuple[dict[str, list[int]], dict[str, str]]:
    """Every request's tokens as ``poll_many`` hands them out, and the errors."""
    got, errors, left = {rid: [] for rid in ids}, {}, set(ids)
    while left:
        reply = drv.poll_many(sorted(left), timeout=60)
        assert not reply.unknown
        for d in reply.deltas:
            got[d.request_id] += d.token_ids
            if d.finished:
                left.discard(d.request_id)
        errors.update(reply.errors)
        left -= set(reply.errors)
    return got, errors


@pytest.mark.parametrize("worker,overlap", [("target", False), ("target", True), ("draft", False)])
def test_a_step_failing_for_one_request_fails_it_alone(llama_pair, worker, overlap):
    """The failing request sits between two seeded ones in one submit: the first step
    (all three) fails, then [first, bad] fails, [first] passes, [bad] fails alone. The
    seeded requests' tokens equal a run without the bad one; only it gets an error, its own."""
    alone = _local(llama_pair, overlap=overlap)
    try:
        want = [o.token_ids for o in alone.wait(alone.submit(PROMPTS, GOOD).request_ids, timeout=120)]
    finally:
        alone.shutdown()
    drv = _local(llama_pair, overlap=overlap)
    try:
        calls = drv.engine.verifiers if worker == "target" else drv.engine.proposer.calls
        raised = break_steps_of(calls[0])
        bad = SamplingParams(max_tokens=20, temperature=0.9, top_k=MARK, seed=8)
        ids = drv.submit([PROMPTS[0], [1, 2, 3, 4], PROMPTS[1]], [GOOD[0], bad, GOOD[1]]).request_ids
        got, errors = stream(drv, ids)
        m = drv.metrics()
        drv.scheduler.check_integrity()
        assert len(drv.engine.calls) == 0           # no call of a failed step left unanswered
    finally:
        drv.shutdown()
    assert [got[ids[0]], got[ids[2]]] == want
    assert list(errors) == [ids[1]] and errors[ids[1]] == "OverflowError: Python int too large to convert to C int"
    assert len(raised) == 3 and m["num_failed_steps"] == 3 and m["num_requests_failed"] == 1
    assert m["target_kv_blocks_used"] == [0] and m["draft_kv_blocks_used"] == [0]
    assert m["num_running"] == m["num_waiting"] == m["num_requests_held"] == 0


def test_a_fault_of_every_step_fails_every_request_then_serving_resumes(llama_pair):
    t, _ = llama_pair
    drv = _local(llama_pair)
    try:
        broken = [True]
        raised = break_steps_of(drv.engine.verifiers[0], lambda plan: broken[0])
        n = 5
        ids = drv.submit([[5 + i, 6, 7] for i in range(n)],
                         [SamplingParams(max_tokens=8, temperature=0.0)] * n).request_ids
        got, errors = stream(drv, ids)
        assert sorted(errors) == sorted(ids) and not any(got.values())
        assert set(errors.values()) == {"OverflowError: Python int too large to convert to C int"}
        m = drv.metrics()
        assert m["num_failed_steps"] == len(raised) == 2 * n - 1 and m["num_requests_failed"] == n
        broken[0] = False
        (out,) = drv.wait(drv.submit([[5, 6, 7]], [SamplingParams(max_tokens=8, temperature=0.0)]).request_ids,
                          timeout=120)
        assert drv.metrics()["target_kv_blocks_used"] == [0]
    finally:
        drv.shutdown()
    assert out.token_ids == hf_greedy(t, [[5, 6, 7]], 8)[0]


def test_limits_are_checked_before_a_prompt_is_tokenized():
    """A text longer than the window can spell is refused untokenized; so is any submit
    once max_pending requests are held. top_k past the vocabulary is off."""
    import threading

    from specray.runtime.model_store import builtin_model

    drv = DriverCore(RuntimeConfig(layout="colocated",
                                   target=builtin_model("tiny-target"), draft=builtin_model("tiny-draft"),
                                   device="cpu", dtype="float32", max_model_len=64, max_pending=2),
                     export_metrics=False)
    gate = threading.Event()
    verify = drv.engine.verifiers[0].submit
    drv.engine.verifiers[0].submit = lambda plan, *a: (gate.wait(60), verify(plan, *a))[1]   # no step ends
    tokenized, tokenize = [], drv._tokenize
    drv._tokenize = lambda text: tokenized.append(len(text)) or tokenize(text)
    try:
        bound = drv.max_prompt_chars
        assert bound is not None
        reply = drv.submit(["a" * (bound + 1)], [SamplingParams(max_tokens=4)])
        assert reply.error.startswith("request 0: prompt has") and "max_model_len 64" in reply.error
        assert tokenized == []
        reply = drv.submit(["a" * bound], [SamplingParams(max_tokens=4)])      # measured, then refused
        assert tokenized == [bound] and "leaves no room" in reply.error
        held = drv.submit(["def f(", "import os"], [SamplingParams(max_tokens=8)] * 2)
        assert held.error is None
        tokenized.clear()
        reply = drv.submit(["x" * 50], [SamplingParams()])
        assert reply.overloaded and tokenized == []
        vocab = drv.vocab_size
        assert drv._prepare([1, 2], SamplingParams(top_k=vocab))[1].top_k == 0
        assert drv._prepare([1, 2], SamplingParams(top_k=vocab - 1))[1].top_k == vocab - 1
    finally:
        gate.set()
        drv.shutdown()


def test_stop_strings_are_matched_without_holding_the_drivers_lock():
    """While the step loop decodes an output to search its stop strings, submits, polls
    and metrics are answered (they take the lock the search no longer holds)."""
    import threading
    import time

    from specray.runtime.model_store import builtin_model

    drv = DriverCore(RuntimeConfig(layout="colocated",
                                   target=builtin_model("tiny-target"), draft=builtin_model("tiny-draft"),
                                   device="cpu", dtype="float32", max_model_len=128),
                     export_metrics=False)
    searching, release = threading.Event(), threading.Event()
    decode = drv._decode

    def slow_decode(ids):
        searching.set()
        release.wait(60)
        return decode(ids)

    drv._decode = slow_decode
    try:
        params = SamplingParams(max_tokens=6, temperature=0.0, stop=["never in this output"])
        (rid,) = drv.submit(["def f("], [params]).request_ids
        assert searching.wait(60)
        t0 = time.monotonic()
        other = drv.submit([[1, 2, 3]], [SamplingParams(max_tokens=2)])
        drv.poll_many([rid], timeout=0.1)
        drv.metrics(workers=False)
        assert time.monotonic() - t0 < 5 and other.error is None
        assert not release.is_set()                 # all of it answered while the search waited
        release.set()
        (out,) = drv.wait([rid], timeout=120)
    finally:
        release.set()
        drv.shutdown()
    assert len(out.token_ids) == 6 and out.finish_reason == "length"
