"""Adaptive speculation on real models: proposal lengths climb to k when the draft is
always right, fall to 0 when it is never right, and greedy output never changes.
(The metrics on Ray's metrics API are checked in test_client.py, on its runtime.)"""

from __future__ import annotations

import torch
from specray_testing import hf_greedy
from transformers import LlamaConfig, LlamaForCausalLM

from specray.runtime.config import RuntimeConfig
from specray.runtime.driver.core import DriverCore
from specray.scheduler.adaptive.step_cost import StepCostModel
from specray.scheduler.sampling_params import SamplingParams

K = 4


def cheap_draft_cost() -> StepCostModel:
    """A controlled cost model in which drafting is cheap next to verifying, frozen so the
    test does not depend on this machine's timings."""
    c = StepCostModel()
    c.target.set_weights([2e-3, 1e-5, 2e-5, 2e-5, 0.0, 0.0])
    c.draft.set_weights([5e-4, 1e-4, 1e-5, 1e-5])
    c.overhead.set_weights([0.0, 0.0])
    c.observe_target = c.observe_draft = c.observe_overhead = lambda *a: None
    return c


def run_spying(cfg, prompts, max_tokens, cost=None):
    drv = DriverCore(cfg.replace(layout="colocated"))
    if cost is not None:
        drv.scheduler.policy.cost = cost
    ks_per_step: list[list[int]] = []
    orig = drv.scheduler.update

    def spy(outcome):
        ks_per_step.append([s.proposal_len for s in outcome.step.seqs])
        return orig(outcome)

    drv.scheduler.update = spy
    try:
        reply = drv.submit(prompts, [SamplingParams(max_tokens=max_tokens, temperature=0.0)] * len(prompts))
        outs = drv.wait(reply.request_ids, timeout=300)
        return outs, ks_per_step, drv.metrics()
    finally:
        drv.shutdown()


def prompts():
    return [torch.randint(0, 97, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (3, 6, 10, 15)]


def test_identical_draft_climbs_to_k(llama_pair):
    t, _ = llama_pair
    cfg = RuntimeConfig(target=t, draft=t, num_speculative_tokens=K, block_size=4, device="cpu", dtype="float32",
                        speculation_policy="adaptive")
    outs, ks, m = run_spying(cfg, prompts(), 40, cheap_draft_cost())
    assert [o.token_ids for o in outs] == hf_greedy(t, prompts(), 40)
    assert m["acceptance_rate"] == 1.0
    # After a few steps every sequence proposes k (until max_tokens caps it at the end).
    assert all(k == K for step in ks[3:6] for k in step)


def test_unrelated_draft_falls_to_zero(llama_pair, tmp_path):
    t, _ = llama_pair
    torch.manual_seed(123)
    cfg = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      bos_token_id=None, eos_token_id=None, pad_token_id=None)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path / "random")
    rcfg = RuntimeConfig(target=t, draft=str(tmp_path / "random"), num_speculative_tokens=K, block_size=4,
                         device="cpu", dtype="float32", speculation_policy="adaptive")
    outs, ks, m = run_spying(rcfg, prompts(), 48, cheap_draft_cost())
    assert [o.token_ids for o in outs] == hf_greedy(t, prompts(), 48)
    assert m["acceptance_rate"] < 0.1
    # Within 6 steps every sequence stops speculating, and nobody starts again: with the
    # draft rejected every time, the rate across sequences that newcomers start from
    # falls too.
    late = ks[6:]
    assert late and not any(k for step in late for k in step)
    assert m["num_spec_off_steps"] >= len(late)


def test_learned_cost_model_keeps_output_exact(llama_pair):
    """The cost model learned from this machine's own step times, not a frozen one."""
    t, d = llama_pair
    cfg = RuntimeConfig(target=t, draft=d, num_speculative_tokens=K, block_size=4, device="cpu", dtype="float32",
                        speculation_policy="adaptive")
    outs, ks, m = run_spying(cfg, prompts(), 30)
    assert [o.token_ids for o in outs] == hf_greedy(t, prompts(), 30)
    # Whether speculating pays here depends on this machine's timings (on a loaded one
    # the model may rightly turn it off from the first step), so only its bounds are fixed.
    assert ks and all(0 <= k <= K for step in ks for k in step) and m["mean_verify_s"] > 0
