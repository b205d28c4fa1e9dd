"""Chunked prefill on real (tiny) models, in process: a long prompt fed 7 tokens a step
beside a decoding request gives transformers' own greedy output, as it does fed whole;
an abort in the middle of a chunked prefill loses nothing of the other requests."""

from __future__ import annotations

import time

import pytest
import torch
from specray_testing import hf_greedy

from specray.runtime.config import RuntimeConfig
from specray.scheduler.sampling_params import SamplingParams

MAX_NEW = 12


def prompts() -> list[list[int]]:
    """A short prompt that decodes all along, and a long one that arrives beside it."""
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, 97, (3,), generator=g).tolist(), torch.randint(0, 97, (50,), generator=g).tolist()]


@pytest.fixture(scope="module")
def reference(llama_pair):
    return hf_greedy(llama_pair[0], prompts(), MAX_NEW)


def config(llama_pair, **kw) -> RuntimeConfig:
    t, d = llama_pair
    return RuntimeConfig(target=t, draft=d, num_speculative_tokens=3, block_size=4, device="cpu", dtype="float32",
                         layout="colocated", **kw)


@pytest.mark.parametrize("caching", [False, True])
def test_chunks_of_7_equal_the_whole_prefill_and_transformers(llama_pair, reference, caching):
    from specray.runtime.driver.core import DriverCore

    runs = {}
    # 8 tokens a step: the short request's one, and 7 for the long prompt's chunk
    for budget in (8, 8192):
        drv = DriverCore(config(llama_pair, max_num_batched_tokens=budget, enable_prefix_caching=caching))
        try:
            reply = drv.submit(prompts(), [SamplingParams(max_tokens=MAX_NEW, temperature=0.0)] * 2)
            outs = drv.wait(reply.request_ids, timeout=600)
            drv.scheduler.check_integrity()
            runs[budget] = outs, drv.metrics()
        finally:
            drv.shutdown()
    (chunked, m), (whole, m_whole) = runs[8], runs[8192]
    assert [o.token_ids for o in chunked] == [o.token_ids for o in whole] == reference
    assert m["num_prefill_chunks"] >= 6 and m_whole["num_prefill_chunks"] == 0
    # the chunks' sampled tokens were dropped: every emitted token is one a request got
    assert m["num_emitted_tokens"] == sum(len(o.token_ids) for o in chunked)
    assert m["num_draft_tokens"] > 0


def test_an_abort_in_the_middle_of_a_chunked_prefill_loses_nothing(llama_pair, reference):
    from specray.runtime.driver.core import DriverCore

    drv = DriverCore(config(llama_pair, max_num_batched_tokens=8))
    try:
        short, long = prompts()
        params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0)
        keep = drv.submit([short], [params]).request_ids
        gone = drv.submit([long], [params]).request_ids
        deadline = time.monotonic() + 60
        while drv.metrics(workers=False)["num_prefill_chunks"] < 2 and time.monotonic() < deadline:
            time.sleep(0.005)
        assert drv.abort(gone) == gone
        again = drv.submit([long], [params]).request_ids
        outs = drv.wait(keep + again, timeout=600)
        drv.scheduler.check_integrity()
        assert [o.token_ids for o in outs] == reference
        assert all(p.num_used_blocks == 0 for p in drv.scheduler.target_pools + drv.scheduler.draft_pools)
    finally:
        drv.shutdown()
