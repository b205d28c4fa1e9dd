"""proposer="eagle3" end to end, co-located in this process (DriverCore): the head's
checkpoint is written by the test (``eagle3_reference``), and the output is the target's
own, greedy, sampled, with logprobs, or with speculation off per request."""

from __future__ import annotations

import pytest
import torch
from eagle3_reference import head_config, save_head, train_head
from specray_testing import hf_greedy, poll_stream

from specray.runtime.config import RuntimeConfig
from specray.runtime.driver.core import DriverCore
from specray.runtime.driver.resume import Tracked, with_seed
from specray.scheduler.sampling_params import SamplingParams

VOCAB, HIDDEN = 96, 32


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(target dir, head dir, a few of the target's greedy continuations)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    n = torch.get_num_threads()
    torch.set_num_threads(1)        # tiny matrices: more threads only contend
    try:
        torch.manual_seed(3)
        target = LlamaForCausalLM(LlamaConfig(
            vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128, initializer_range=0.25, tie_word_embeddings=False,
            bos_token_id=None, eos_token_id=None, pad_token_id=None)).eval()
        out = tmp_path_factory.mktemp("eagle3rt")
        target.save_pretrained(out / "target")
        prompts = torch.randint(0, VOCAB, (3, 4))
        with torch.no_grad():
            corpus = target.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=28,
                                     do_sample=False, pad_token_id=0, eos_token_id=None)
        cfg = head_config(layer_ids=None)          # the default layers: entering 2, N // 2, N - 3
        weights, d2t = train_head(target, corpus, cfg, (2, 2, 1))
        head = save_head(out / "head", cfg, weights, d2t)
    finally:
        torch.set_num_threads(n)
    return str(out / "target"), head, corpus


def config(pair) -> RuntimeConfig:
    target, head, _ = pair
    return RuntimeConfig(layout="colocated", target=target, draft=head, proposer="eagle3", num_speculative_tokens=3,
                         block_size=4, device="cpu", dtype="float32", torch_threads=1)


@pytest.fixture(scope="module")
def driver(pair):
    drv = DriverCore(config(pair))
    yield drv
    drv.shutdown()


def run(drv, prompts, params):
    return drv.wait(drv.submit(prompts, params).request_ids, timeout=120)


def test_greedy_output_is_the_targets_and_the_head_is_right_often(driver, pair):
    target, _, corpus = pair
    prompts = [corpus[0, :6].tolist(), corpus[1, :8].tolist(), corpus[2, :5].tolist(), [9, 19, 29]]
    before = driver.metrics()
    outs = run(driver, prompts, [SamplingParams(max_tokens=20, temperature=0.0)] * len(prompts))
    assert [list(o.token_ids) for o in outs] == hf_greedy(target, prompts, 20)
    m = driver.metrics()
    drafted = m["num_draft_tokens"] - before["num_draft_tokens"]
    accepted = m["num_accepted_tokens"] - before["num_accepted_tokens"]
    assert drafted > 30 and accepted > 10, (drafted, accepted)


def test_sampled_logprobs_and_plain_requests_run_beside_greedy_ones(driver, pair):
    target, _, corpus = pair
    prompt = corpus[0, :6].tolist()
    params = [SamplingParams(max_tokens=12, temperature=0.8, seed=5),
              SamplingParams(max_tokens=12, temperature=0.8, seed=5, top_k=5, top_p=0.9),
              SamplingParams(max_tokens=12, temperature=0.0, logprobs=2),
              SamplingParams(max_tokens=12, temperature=0.0, speculation=False)]
    outs = run(driver, [prompt] * 4, params)
    again = run(driver, [prompt], params[:1])
    assert list(again[0].token_ids) == list(outs[0].token_ids)            # a seed reproduces its request
    want = hf_greedy(target, [prompt], 12)[0]
    assert list(outs[2].token_ids) == want and list(outs[3].token_ids) == want
    assert len(outs[2].logprobs) == 12
    assert outs[3].num_draft_tokens == 0 and outs[2].num_draft_tokens > 0


def test_eagle3_needs_a_head_and_one_target_worker(pair):
    target, head, _ = pair
    with pytest.raises(ValueError, match="draft: proposer='eagle3' needs an EAGLE-3 head"):
        RuntimeConfig(target=target, proposer="eagle3")
    with pytest.raises(ValueError, match="num_target_workers"):
        RuntimeConfig(target=target, draft=head, proposer="eagle3", num_target_workers=2)
    with pytest.raises(ValueError, match="draft must be None"):
        RuntimeConfig(target=target, draft=head, proposer="ngram")


def test_a_request_cut_mid_stream_resumes_on_a_fresh_driver_with_the_same_tokens(driver, pair):
    """A driver's fail-over, in process: the client's state handed to a new driver, whose
    target and head recompute the request's cache (the head from the target's states)."""
    prompt = pair[2][1, :8].tolist()
    params = SamplingParams(max_tokens=24, temperature=0.9, seed=4)
    full, seed = poll_stream(driver, prompt, params)
    cut, _ = poll_stream(driver, prompt, params, upto=8)
    t = Tracked("x", "x", prompt, with_seed(params, seed))
    for d in cut:
        t.add_delta(d)
    again, p, resume = t.resubmission()
    fresh = DriverCore(config(pair))
    try:
        rest, _ = poll_stream(fresh, again, p, resume)
        drafted = fresh.metrics()["num_draft_tokens"]
    finally:
        fresh.shutdown()
    tokens = lambda ds: [x for d in ds for x in d.token_ids]  # noqa: E731
    assert tokens(cut) + tokens(rest) == tokens(full)
    assert drafted > 0


def test_eagle3_and_suffix_decoding_per_sequence_keep_the_targets_output(pair):
    """eagle3+suffix: where suffix decoding has seen the continuation (a prompt asked
    again), its proposal is verified instead of the head's for that sequence."""
    target, _, corpus = pair
    drv = DriverCore(config(pair).replace(proposer="eagle3+suffix"))
    prompts = [corpus[0, :6].tolist(), [9, 19, 29, 39]]
    try:
        first = run(drv, prompts, [SamplingParams(max_tokens=20, temperature=0.0)] * 2)
        again = run(drv, prompts, [SamplingParams(max_tokens=20, temperature=0.0)] * 2)
        m = drv.metrics()
    finally:
        drv.shutdown()
    want = hf_greedy(target, prompts, 20)
    assert [list(o.token_ids) for o in first] == want and [list(o.token_ids) for o in again] == want
    assert m["num_accepted_tokens"] > 0 and m["suffix_cached_requests"] == 4
    # The prompt the head never saw: asked again, suffix decoding's proposals carry it.
    assert again[1].num_accepted_tokens > first[1].num_accepted_tokens, (first[1], again[1])
