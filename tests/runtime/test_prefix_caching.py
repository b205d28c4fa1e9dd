"""Prefix caching on real (tiny) models, in process: greedy output equals transformers'
own with the cache on and off, a shared prefix is found cached in both models, and the
draft's acceptance with hits is exactly its acceptance without (its KV was restored)."""

from __future__ import annotations

import pytest
import torch
from specray_testing import hf_greedy

from specray.runtime.config import RuntimeConfig
from specray.scheduler.sampling_params import SamplingParams

MAX_NEW = 16


def chat_prompts() -> list[list[int]]:
    """A 40-token "system prompt" and five questions after it."""
    g = torch.Generator().manual_seed(51)
    system = torch.randint(0, 97, (40,), generator=g).tolist()
    return [system + torch.randint(0, 97, (2 + i,), generator=g).tolist() for i in range(5)]


def serve_in_turns(cfg: RuntimeConfig, waves: list[list[list[int]]]):
    """Each wave submitted once the one before it finished; returns the outputs and the metrics."""
    from specray.runtime.driver.core import DriverCore

    drv = DriverCore(cfg.replace(layout="colocated"))
    outs = []
    try:
        for wave in waves:
            reply = drv.submit(wave, [SamplingParams(max_tokens=MAX_NEW, temperature=0.0)] * len(wave))
            assert reply.error is None, reply.error
            got = drv.wait(reply.request_ids, timeout=600)
            assert got is not None
            outs += got
            drv.scheduler.check_integrity()
        assert all(p.num_used_blocks == 0 for p in drv.scheduler.target_pools + drv.scheduler.draft_pools)
        return outs, drv.metrics()
    finally:
        drv.shutdown()


@pytest.fixture(scope="module")
def chat_reference(llama_pair):
    t, _ = llama_pair
    return hf_greedy(t, chat_prompts(), MAX_NEW)


@pytest.mark.parametrize("proposer", ["draft", "ngram"])
def test_shared_prefixes_equal_transformers_and_accept_alike_with_caching_on_and_off(llama_pair, chat_reference,
                                                                                     proposer):
    t, d = llama_pair
    ps = chat_prompts()
    waves = [ps[:1], ps[1:3], ps[3:]]
    runs = {}
    for caching in (False, True):
        cfg = RuntimeConfig(target=t, draft=d if proposer == "draft" else None, proposer=proposer,
                            num_speculative_tokens=3, block_size=4, device="cpu", dtype="float32",
                            enable_prefix_caching=caching)
        runs[caching] = serve_in_turns(cfg, waves)
    for caching, (outs, _) in runs.items():
        assert [o.token_ids for o in outs] == chat_reference, f"caching {caching}"
    (off, m_off), (on, m_on) = runs[False], runs[True]
    assert [o.num_cached_tokens for o in off] == [0] * 5 and m_off["prefix_cache_hits"] == 0
    # the first request computes everything; every later one finds the 40-token prefix
    assert on[0].num_cached_tokens == 0 and all(o.num_cached_tokens >= 32 for o in on[1:])
    assert m_on["prefix_cache_hits"] == sum(o.num_cached_tokens for o in on)
    assert m_on["prefix_cache_queries"] == sum(len(p) for p in ps)
    assert 0.5 < m_on["prefix_cache_hit_rate"] < 1
    # with hits the draft proposes and is accepted exactly as without them
    assert [(o.num_draft_tokens, o.num_accepted_tokens) for o in on] == \
        [(o.num_draft_tokens, o.num_accepted_tokens) for o in off]
    assert m_on["num_draft_tokens"] > 0


def test_a_small_pool_shares_evicts_and_preempts_and_still_equals_transformers(llama_pair, chat_reference):
    """Five shared-prefix prompts at once in pools of 24 blocks (96 slots): they share the
    prefix's blocks, outgrow the pool, are preempted and recomputed from the cache."""
    t, d = llama_pair
    cfg = RuntimeConfig(target=t, draft=d, num_speculative_tokens=3, block_size=4, num_kv_blocks=24, device="cpu",
                        dtype="float32")
    ps = chat_prompts()
    outs, m = serve_in_turns(cfg, [ps[:1], ps[1:]])
    assert [o.token_ids for o in outs] == chat_reference
    assert m["num_preemptions"] > 0 and m["prefix_cache_hits"] > 0
