"""Several draft and target workers under one driver (in-process): proposals merged from
every draft shard, target workers data parallel, outputs identical to one of each."""

from __future__ import annotations

import pytest
import torch
from specray_testing import hf_greedy, run_local

from specray.runtime.config import RuntimeConfig
from specray.runtime.driver.core import DriverCore
from specray.scheduler.sampling_params import SamplingParams


@pytest.mark.parametrize("n_draft,n_target", [(2, 1), (1, 2), (3, 2)])
def test_pools_give_the_same_greedy_output(llama_pair, n_draft, n_target):
    t, d = llama_pair
    prompts = [torch.randint(0, 97, (2 + 3 * i,), generator=torch.Generator().manual_seed(50 + i)).tolist()
               for i in range(9)]
    params = [SamplingParams(max_tokens=16 + i, temperature=0.0) for i in range(9)]
    cfg = RuntimeConfig(target=t, draft=d, num_speculative_tokens=3, block_size=4, device="cpu", dtype="float32",
                        num_draft_workers=n_draft, num_target_workers=n_target, max_model_len=60)
    outs, m = run_local(cfg, prompts, params)
    expected = hf_greedy(t, prompts, 16 + 8)
    assert [o.token_ids for o in outs] == [e[:16 + i] for i, e in enumerate(expected)]
    assert m["num_draft_workers"] == n_draft and m["num_target_workers"] == n_target
    assert m["num_draft_tokens"] > 0


def test_every_worker_serves_a_share_and_sequences_stay_put(llama_pair):
    t, d = llama_pair
    cfg = RuntimeConfig(target=t, draft=d, num_speculative_tokens=2, block_size=4, device="cpu", dtype="float32",
                        num_draft_workers=2, num_target_workers=2)
    drv = DriverCore(cfg.replace(layout="colocated"))
    try:
        seen: dict[int, tuple[int, int]] = {}
        orig_update = drv.scheduler.update

        def spy(outcome):
            step = outcome.step
            for r, seqs in enumerate(step.target_seqs):
                for s in seqs:
                    assert s.target_rank == r
                    assert seen.setdefault(s.seq_id, (s.target_rank, s.draft_rank)) == (s.target_rank, s.draft_rank)
            for r, seqs in enumerate(step.draft_seqs):
                assert all(s.draft_rank == r for s in seqs)
            return orig_update(outcome)

        drv.scheduler.update = spy
        reply = drv.submit([[i + 1] * (3 + i) for i in range(8)], [SamplingParams(max_tokens=10, temperature=0.0)] * 8)
        drv.wait(reply.request_ids, timeout=300)
        assert {tr for tr, _ in seen.values()} == {0, 1}
        assert {dr for _, dr in seen.values()} == {0, 1}
    finally:
        drv.shutdown()


def test_a_driver_that_refuses_its_config_calls_the_worker_start_off(tmp_path, monkeypatch):
    """The workers start while the driver reads the configs; a refusal (here a draft with
    another tokenizer) calls the start off instead of waiting for the models to load."""
    from specray_testing import disagreeing_pair

    import specray.runtime.driver.core
    from specray.runtime.transport.worker_pool import StartCancelled

    seen = []

    def start_workers(cfg, cancel):
        # A model that takes long to load: only being called off ends this start.
        seen.append(cancel.wait(timeout=120))
        raise StartCancelled("called off")

    monkeypatch.setattr(specray.runtime.driver.core, "start_workers", start_workers)
    t, other_draft = disagreeing_pair(tmp_path)
    with pytest.raises(ValueError, match="do not share a tokenizer"):
        DriverCore(RuntimeConfig(layout="colocated",
                                 target=t, draft=other_draft, block_size=4, device="cpu", dtype="float32"))
    assert seen == [True]
