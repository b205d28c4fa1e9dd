"""Resuming a request on a fresh driver, without Ray: the arithmetic of what a client
holds (``specray.runtime.driver.resume``), then in-process drivers, one dropped mid-stream and a
new one handed the client's state, against the uninterrupted run: max_tokens counts what
was emitted, the prompt stays the prompt, a stop string's held-back tail and a stop
string across the resume point, logprobs, seeds drawn by the driver."""

from __future__ import annotations

import pytest
from specray_testing import poll_stream

import specray
from specray import RuntimeConfig, SamplingParams
from specray.runtime.driver.core import DriverCore
from specray.runtime.driver.resume import InFlight, Progress, Resume, Tracked, with_seed
from specray.runtime.driver.stop_strings import held_back
from specray.runtime.request_output import RequestOutput
from specray.scheduler.token_logprob import TokenLogprob


# -- the arithmetic ---------------------------------------------------------------------
def test_a_request_holding_nothing_is_resubmitted_as_it_came_with_its_drivers_seed():
    flight = InFlight()
    flight.add(["a"], ["def f():"], [SamplingParams(max_tokens=8)], [1234])
    prompt, params, resume = flight.get("a").resubmission()
    assert prompt == "def f():" and resume is None
    assert params.seed == 1234 and params.max_tokens == 8


def test_a_request_holding_output_is_resubmitted_as_prompt_ids_plus_output():
    params = SamplingParams(max_tokens=8, seed=5, logprobs=1)
    t = Tracked("a", "a", "text", params)
    lp = [TokenLogprob(3, -0.5, [(3, -0.5)]), TokenLogprob(4, -0.25, [(4, -0.25)])]
    t.add_delta(RequestOutput("a", [1, 2], [3], "x", None, 2, 1, lp[:1]))
    t.add_delta(RequestOutput("a", [1, 2], [4], "", None, 4, 2, lp[1:]))
    prompt, p, resume = t.resubmission()
    assert prompt == [1, 2] and p is params
    assert resume == Resume([1, 2], [3, 4], lp, text_len=1, num_draft_tokens=4, num_accepted_tokens=2)
    # A wait's progress adds the same way; the first one names the prompt's ids.
    w = Tracked("b", "b", "text", SamplingParams(max_tokens=8, seed=5))
    w.add_progress(Progress("b", [3], None, 1, 0, prompt_token_ids=[1, 2]))
    w.add_progress(Progress("b", [4, 5], None, 3, 1))
    assert w.resubmission()[2] == Resume([1, 2], [3, 4, 5], None, 0, 3, 1)


def test_news_from_a_driver_the_request_has_moved_away_from_is_dropped():
    flight = InFlight()
    flight.add(["a"], [[1, 2]], [SamplingParams(max_tokens=8)], [9])
    (t,) = flight.resubmissions()[0]
    flight.moved([t], ["b"])
    assert not flight.received("a", "a", RequestOutput("a", [1, 2], [3]), delta=True)
    assert flight.received("a", "b", RequestOutput("b", [1, 2], [3]), delta=True)
    assert flight.get("a").token_ids == [3] and flight.current(["a"]) == ["b"] and flight.epoch == 1


@pytest.mark.parametrize("change, field", [
    (dict(token_ids=[1] * 8), "finished"),
    (dict(prompt_token_ids=[]), "prompt_token_ids"),
    (dict(token_ids=[1, 10**6]), "token_ids"),
    (dict(logprobs=[]), "logprobs"),
    (dict(text_len=-1), "text_len"),
])
def test_a_resume_that_cannot_be_an_unfinished_request_is_refused(change, field):
    r = Resume([1, 2], [3], None)
    for k, v in change.items():
        setattr(r, k, v)
    with pytest.raises(ValueError, match=field):
        r.check(SamplingParams(max_tokens=8, seed=1), vocab_size=100, max_model_len=64)
    with pytest.raises(ValueError, match="seed"):
        Resume([1, 2], [3], None).check(SamplingParams(max_tokens=8), vocab_size=100, max_model_len=64)


# -- in-process drivers -----------------------------------------------------------------
@pytest.fixture(scope="module")
def cfg():
    return RuntimeConfig(target=specray.builtin_model("tiny-target"), draft=specray.builtin_model("tiny-draft"),
                         num_speculative_tokens=3, device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def driver(cfg):
    drv = DriverCore(cfg.replace(layout="colocated"))
    yield drv
    drv.shutdown()


def tracked(prompt, params, seed, deltas) -> Tracked:
    t = Tracked("x", "x", prompt, with_seed(params, seed))
    for d in deltas:
        t.add_delta(d)
    return t


def whole(deltas) -> tuple:
    return ([t for d in deltas for t in d.token_ids], "".join(d.text for d in deltas), deltas[-1].finish_reason,
            deltas[-1].num_draft_tokens, deltas[-1].num_accepted_tokens)


def test_a_sampled_stream_cut_at_a_step_resumes_on_a_new_driver_exactly(cfg, driver):
    """Unseeded: the driver's seed comes back in the submit reply. The resumed request's
    steps propose at the same positions, so even the draft/accepted counts match."""
    params = SamplingParams(max_tokens=48, temperature=0.9, logprobs=1)
    full, seed = poll_stream(driver, "def fibonacci(n):", params)
    same_seed = SamplingParams(max_tokens=48, temperature=0.9, logprobs=1, seed=seed)
    assert whole(poll_stream(driver, "def fibonacci(n):", same_seed)[0]) == whole(full)
    cut, _ = poll_stream(driver, "def fibonacci(n):", same_seed, upto=10)
    t = tracked("def fibonacci(n):", params, seed, cut)
    prompt, p, resume = t.resubmission()
    fresh = DriverCore(cfg.replace(layout="colocated"))         # the restarted driver
    try:
        rest, _ = poll_stream(fresh, prompt, p, resume)
    finally:
        fresh.shutdown()
    assert whole(cut + rest) == whole(full)
    assert all(d.prompt_token_ids == full[0].prompt_token_ids for d in rest)
    got = [lp for d in cut + rest for lp in d.logprobs]
    want = [lp for d in full for lp in d.logprobs]
    assert [x.token_id for x in got] == [x.token_id for x in want]
    assert [x.logprob for x in got] == pytest.approx([x.logprob for x in want], abs=1e-4)


def test_greedy_resumes_from_any_token_with_held_back_stop_tails(driver):
    """Greedy output does not depend on where steps end, so every cut point is a valid
    resume: at each, the client holds the text a stream had sent (a tail that could begin
    a stop string held back), and the rest arrives with nothing lost or repeated, the stop
    string matched across the cut, max_tokens counted from the original prompt."""
    prompt = "from os import"
    probe, _ = poll_stream(driver, prompt, SamplingParams(max_tokens=40, temperature=0.0))
    text = "".join(d.text for d in probe)
    # A string the output holds from its 15th character or later, first there: it ends there.
    at = next(k for k in range(15, len(text) - 3) if text.find(text[k:k + 3]) == k)
    stop = text[at:at + 3]
    params = SamplingParams(max_tokens=40, temperature=0.0, stop=[stop], logprobs=0, seed=3)
    full, _ = poll_stream(driver, prompt, params)
    tokens, want_text = whole(full)[:2]
    assert whole(full)[2] == "stop" and want_text == text[:at]
    tok = driver.tokenizer
    tails = 0
    for cut in range(1, len(tokens)):
        sent = tok.decode(tokens[:cut], skip_special_tokens=True).rstrip("\ufffd")
        tails += held_back(sent, [stop]) > 0
        sent = sent[:len(sent) - held_back(sent, [stop])]
        resume = Resume(list(full[0].prompt_token_ids), tokens[:cut], [lp for d in full for lp in d.logprobs][:cut],
                        text_len=len(sent))
        rest, _ = poll_stream(driver, list(full[0].prompt_token_ids), params, resume)
        got = tokens[:cut] + [t for d in rest for t in d.token_ids]
        assert (got, sent + "".join(d.text for d in rest), rest[-1].finish_reason) == (tokens, want_text, "stop")
        assert sum(len(d.logprobs) for d in rest) == len(tokens) - cut
    assert tails > 0          # some cuts fell where a stream holds a tail back


def test_max_tokens_counts_what_was_emitted_before_the_resume(driver):
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, seed=1)
    full, _ = poll_stream(driver, [103, 104, 105], params)
    tokens = whole(full)[0]
    assert len(tokens) == 12
    rest, _ = poll_stream(driver, [103, 104, 105], params, Resume([103, 104, 105], tokens[:5], None))
    assert tokens[:5] + whole(rest)[0] == tokens and rest[-1].finish_reason == "length"
