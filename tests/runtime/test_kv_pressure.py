"""A KV pool much smaller than the load: preemption by recompute, same greedy output;
and sequences that reach max_model_len."""

from __future__ import annotations

import pytest
import torch
from specray_testing import hf_greedy, make_pair, run_local

from specray.runtime.config import RuntimeConfig
from specray.runtime.driver.core import DriverCore
from specray.scheduler.sampling_params import SamplingParams


@pytest.mark.parametrize("proposer", ["draft", "ngram"])
def test_preemption_keeps_greedy_output(llama_pair, proposer):
    t, d = llama_pair
    prompts = [torch.randint(0, 97, (4 + 3 * i,), generator=torch.Generator().manual_seed(i)).tolist()
               for i in range(10)]
    params = [SamplingParams(max_tokens=24, temperature=0.0)] * 10
    common = dict(target=t, draft=d if proposer == "draft" else None, proposer=proposer,
                  num_speculative_tokens=3, block_size=4, device="cpu", dtype="float32")
    ample, m_ample = run_local(RuntimeConfig(**common), prompts, params)
    tight, m_tight = run_local(RuntimeConfig(**common, num_kv_blocks=24), prompts, params)
    assert m_ample["num_preemptions"] == 0
    assert m_tight["num_preemptions"] > 0
    assert [o.token_ids for o in tight] == [o.token_ids for o in ample]
    assert all(len(o.token_ids) == 24 for o in tight)


def test_sequences_near_max_model_len_stop_with_length(llama_pair):
    t, d = llama_pair
    max_len = 40
    prompts = [[5] * 37, [6] * 30, [7] * 10]
    cfg = RuntimeConfig(target=t, draft=d, num_speculative_tokens=5, block_size=4, device="cpu", dtype="float32",
                        max_model_len=max_len)
    outs, m = run_local(cfg, prompts, [SamplingParams(max_tokens=100, temperature=0.0)] * 3)
    for p, o in zip(prompts, outs):
        assert len(p) + len(o.token_ids) == max_len
        assert o.finish_reason == "length"
    # The 37-token prompt leaves room for 3 tokens: k_i is capped so that len + k_i + 1 <= 40.
    assert outs[0].num_draft_tokens <= 2


def test_draft_shorter_window_turns_speculation_off(tmp_path):
    """Past the draft's max_position_embeddings a sequence decodes on the target alone
    and still equals plain greedy decoding."""
    t, d = make_pair(tmp_path, "llama", max_len=128, draft_max_len=24)
    prompt = torch.randint(0, 97, (16,), generator=torch.Generator().manual_seed(3)).tolist()
    cfg = RuntimeConfig(target=t, draft=d, num_speculative_tokens=4, block_size=4, device="cpu", dtype="float32")
    outs, m = run_local(cfg, [prompt], [SamplingParams(max_tokens=30, temperature=0.0)])
    assert outs[0].token_ids == hf_greedy(t, [prompt], 30)[0]
    # Only positions below 24 could be proposed.
    assert 0 < outs[0].num_draft_tokens <= 24 - 16


def test_prompt_filling_max_model_len_is_rejected(llama_pair):
    t, d = llama_pair
    drv = DriverCore(RuntimeConfig(layout="colocated", target=t, draft=d, block_size=4, device="cpu", dtype="float32",
                                   max_model_len=16))
    try:
        reply = drv.submit([[1] * 16], [SamplingParams()])
        assert reply.error and "max_model_len" in reply.error and "request 0" in reply.error
        reply = drv.submit([[1] * 15], [SamplingParams(max_tokens=4, temperature=0.0)])
        (o,) = drv.wait(reply.request_ids, timeout=60)
        assert len(o.token_ids) == 1 and o.finish_reason == "length"
    finally:
        drv.shutdown()


def test_request_larger_than_any_pool_is_refused_at_submit(llama_pair):
    t, d = llama_pair
    drv = DriverCore(RuntimeConfig(layout="colocated", target=t, draft=d, block_size=4, device="cpu", dtype="float32",
                                   num_kv_blocks=8))
    try:
        reply = drv.submit([[1, 2, 3], [1] * 20], [SamplingParams(max_tokens=4), SamplingParams(max_tokens=20)])
        assert reply.error and reply.error.startswith("request 1:") and "max_tokens" in reply.error
        reply = drv.submit([[1] * 20], [SamplingParams(max_tokens=12, temperature=0.0)])   # 32 slots = 8 blocks
        (o,) = drv.wait(reply.request_ids, timeout=60)
        assert len(o.token_ids) == 12
    finally:
        drv.shutdown()
