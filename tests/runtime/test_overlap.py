"""Overlap (pre-drafting the next window while the target verifies) changes no output:
greedy runs equal the serial runs token for token, with pre-drafted windows actually taken
(a draft equal to its target makes every optimistic branch hold), in process and through
actors."""

from __future__ import annotations

import pytest

from specray.runtime.config import RuntimeConfig
from specray.runtime.driver.core import DriverCore
from specray.scheduler.sampling_params import SamplingParams

PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [3, 1, 4, 1, 5, 9, 2, 6], [12] * 7]


def run(cfg: RuntimeConfig, layout: str, prompts, params):
    drv = DriverCore(cfg.replace(layout=layout), export_metrics=False)
    try:
        if drv.engine.book is not None:
            drv.engine.book.min_use = 0.0       # pre-draft every step, whatever the batch
        reply = drv.submit(prompts, [params] * len(prompts))
        assert reply.error is None
        outs = drv.wait(reply.request_ids, timeout=600)
        return [o.token_ids for o in outs], drv.metrics()
    finally:
        drv.shutdown()


def config(target, draft, **kw) -> RuntimeConfig:
    return RuntimeConfig(target=target, draft=draft, num_speculative_tokens=3, block_size=4, device="cpu",
                         dtype="float32", seed=3, **kw)


@pytest.mark.parametrize("same", [True, False])
@pytest.mark.parametrize("max_num_seqs", [1, 4])
def test_greedy_outputs_equal_serial_in_process(llama_pair, same, max_num_seqs):
    target, draft = llama_pair
    draft = target if same else draft
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    serial, m0 = run(config(target, draft, max_num_seqs=max_num_seqs), "colocated", PROMPTS, params)
    over, m1 = run(config(target, draft, max_num_seqs=max_num_seqs, overlap=True), "colocated", PROMPTS, params)
    assert over == serial
    assert m0["num_predrafted_windows"] == 0 and m1["overlap"] and not m0["overlap"]
    assert m1["num_predraft_windows_used"] + m1["num_predraft_windows_dropped"] <= m1["num_predrafted_windows"]
    if same:
        # Every branch holds: after each request's first step its windows come pre-drafted.
        assert m1["num_predraft_windows_used"] > 0
        assert m1["num_draft_tokens"] == m0["num_draft_tokens"]


def test_pre_drafts_stay_inside_a_max_model_len_below_the_models_window(llama_pair):
    """Requests run to the end of a max_model_len smaller than either model's window: a
    pre-draft reserves draft slots only up to the draft worker's window (which that
    max_model_len bounds), or the worker refuses the plan."""
    target, _ = llama_pair
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    serial, _ = run(config(target, target, max_num_seqs=4, max_model_len=24), "colocated", PROMPTS, params)
    over, m = run(config(target, target, max_num_seqs=4, max_model_len=24, overlap=True), "colocated", PROMPTS, params)
    assert over == serial and m["num_predraft_windows_used"] > 0
    assert all(len(p) + len(t) == 24 for p, t in zip(PROMPTS, over))       # each ran to the window's end


def test_sampled_outputs_equal_serial_in_process(llama_pair):
    """Seeded sampling: the same draws whether a window was drafted ahead or not (the
    draft's uniforms are keyed by position), so outputs are equal, not just alike."""
    target, _ = llama_pair
    params = SamplingParams(max_tokens=16, temperature=0.9, top_k=20, seed=5, ignore_eos=True)
    serial, _ = run(config(target, target, max_num_seqs=1), "colocated", PROMPTS, params)
    over, m = run(config(target, target, max_num_seqs=1, overlap=True), "colocated", PROMPTS, params)
    assert over == serial and m["num_predraft_windows_used"] > 0


def test_greedy_outputs_equal_serial_through_actors(llama_pair, ray_module):
    target, draft = llama_pair
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    # overlap left at its default: off in process, on in the actor layout.
    serial, m0 = run(config(target, target, max_num_seqs=2), "colocated", PROMPTS, params)
    # The actor layout (the target in the driver's process); one group in flight, as at
    # batch 1: pre-drafts serve steps that run alone.
    over, m = run(config(target, target, max_num_seqs=2, ray_address=None, groups_in_flight=1),
                  "actors", PROMPTS, params)
    assert m0["overlap"] is False and m["overlap"] is True
    assert over == serial and m["num_predraft_windows_used"] > 0
    assert m["draft_hidden_s"] > 0.0


def test_overlap_is_the_drivers_choice_unless_asked_and_off_when_colocated(llama_pair):
    from specray.runtime.settled import settle

    target, draft = llama_pair
    assert config(target, draft).speculation.overlap is None        # the driver decides (see above)
    assert config(target, draft, overlap=False).speculation.overlap is False
    assert config(target, draft, overlap=True).speculation.overlap
    # Settled once by the driver: None is on in the actor layout, off co-located; an
    # explicit True stays (in process pre-drafts run in turn), off for host proposers.
    assert settle(config(target, draft, layout="actors")).speculation.overlap is True
    assert settle(config(target, draft, layout="colocated")).speculation.overlap is False
    assert settle(config(target, draft, layout="colocated", overlap=True)).speculation.overlap is True
    assert settle(config(target, None, layout="actors", proposer="ngram", overlap=True)).speculation.overlap is False
    with pytest.raises(ValueError, match="layout 'auto'"):
        settle(config(target, draft))
    with pytest.raises(ValueError, match="overlap must be True or False"):
        config(target, draft, overlap="yes")
