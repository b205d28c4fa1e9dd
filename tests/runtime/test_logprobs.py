"""Per-request logprobs and plain decoding through the whole in-process path (driver,
scheduler, workers): every emitted token's logprob is transformers' own log-softmax at
the position that emitted it, whatever proposed it; ``speculation=False`` proposes
nothing and changes no token."""

from __future__ import annotations

import pytest
import torch
from specray_testing import hf_greedy, run_local

from specray.runtime.config import RuntimeConfig
from specray.runtime.driver.core import DriverCore
from specray.scheduler.sampling_params import SamplingParams
from specray.workers import step_graphs

TOL = 1e-4
MAX_NEW = 14


def prompts(n: int = 6) -> list[list[int]]:
    return [torch.randint(0, 97, (2 + 3 * i,), generator=torch.Generator().manual_seed(40 + i)).tolist()
            for i in range(n)]


@pytest.fixture(scope="module")
def reference_model(llama_pair):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(llama_pair[0], dtype=torch.float32).eval()


@torch.inference_mode()
def reference_logprobs(model, prompt: list[int], output: list[int]) -> torch.Tensor:
    """[len(output), V]: the plain model's log-softmax at each output token's position."""
    ids = torch.tensor([prompt + output])
    logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0].float()
    return torch.log_softmax(logits[len(prompt) - 1:-1], dim=-1)


def assert_reference_logprobs(model, prompt, out, n: int) -> None:
    assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids)
    want = reference_logprobs(model, prompt, out.token_ids)
    for j, (tok, lp) in enumerate(zip(out.token_ids, out.logprobs)):
        assert lp.token_id == tok
        assert abs(lp.logprob - want[j, tok].item()) < TOL, (j, lp.logprob, want[j, tok].item())
        values, ids = want[j].topk(n)
        assert [t for t, _ in lp.top] == ids.tolist(), j
        assert torch.allclose(torch.tensor([x for _, x in lp.top]), values, atol=TOL)


def config(llama_pair, proposer: str, **kw) -> RuntimeConfig:
    t, d = llama_pair
    return RuntimeConfig(target=t, draft=d if "draft" in proposer else None, proposer=proposer,
                         num_speculative_tokens=3, block_size=4, device="cpu", dtype="float32", **kw)


def mixed_params(speculation: bool = True) -> list[SamplingParams]:
    """Greedy and seeded sampled requests asking for 0, 3 or 20 alternatives, and two that
    ask for none."""
    greedy = dict(max_tokens=MAX_NEW, temperature=0.0, speculation=speculation)
    sampled = dict(max_tokens=MAX_NEW, temperature=0.8, top_k=10, speculation=speculation)
    return [SamplingParams(**greedy, logprobs=0), SamplingParams(**greedy, logprobs=3),
            SamplingParams(**sampled, seed=7, logprobs=20), SamplingParams(**sampled, seed=8, logprobs=2),
            SamplingParams(**greedy), SamplingParams(**sampled, seed=9)]


@pytest.mark.parametrize("proposer", ["draft", "ngram", "none"])
def test_logprobs_equal_the_plain_models_log_softmax(llama_pair, reference_model, proposer):
    ps, params = prompts(), mixed_params()
    outs, m = run_local(config(llama_pair, proposer), ps, params)
    for p, sp, o in zip(ps, params, outs):
        if sp.logprobs is None:
            assert o.logprobs is None
        else:
            assert_reference_logprobs(reference_model, p, o, sp.logprobs)
    if proposer != "none":
        assert m["num_accepted_tokens"] > 0          # accepted proposals carry logprobs too
    # Asking changes no token: greedy requests equal generate.
    assert [outs[i].token_ids for i in (0, 1, 4)] == hf_greedy(llama_pair[0], [ps[i] for i in (0, 1, 4)], MAX_NEW)

    # Decoding plainly gives the greedy requests the same tokens and the same logprobs,
    # and proposes nothing.
    plain, _ = run_local(config(llama_pair, proposer), ps, mixed_params(speculation=False))
    assert all(o.num_draft_tokens == 0 for o in plain)
    for i in (0, 1):
        assert plain[i].token_ids == outs[i].token_ids
        for a, b in zip(plain[i].logprobs, outs[i].logprobs, strict=True):
            assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < TOL
            assert [t for t, _ in a.top] == [t for t, _ in b.top]
            assert all(abs(x - y) < TOL for (_, x), (_, y) in zip(a.top, b.top))
    for i in (2, 3):
        assert_reference_logprobs(reference_model, ps[i], plain[i], params[i].logprobs)


def test_speculation_off_requests_share_a_batch_with_speculating_ones(llama_pair):
    ps = prompts(4)
    params = [SamplingParams(max_tokens=MAX_NEW, temperature=0.0, speculation=i % 2 == 0) for i in range(4)]
    outs, m = run_local(config(llama_pair, "draft"), ps, params)
    assert [o.token_ids for o in outs] == hf_greedy(llama_pair[0], ps, MAX_NEW)
    assert outs[1].num_draft_tokens == outs[3].num_draft_tokens == 0
    assert outs[0].num_draft_tokens > 0 and outs[2].num_draft_tokens > 0
    assert m["num_draft_tokens"] == outs[0].num_draft_tokens + outs[2].num_draft_tokens


def test_preempted_and_recomputed_sequences_keep_exact_logprobs(llama_pair, reference_model):
    ps = [torch.randint(0, 97, (4 + 3 * i,), generator=torch.Generator().manual_seed(i)).tolist() for i in range(8)]
    params = [SamplingParams(max_tokens=20, temperature=0.0 if i % 2 else 0.9, seed=i, logprobs=2) for i in range(8)]
    outs, m = run_local(config(llama_pair, "draft", num_kv_blocks=20), ps, params)
    assert m["num_preemptions"] > 0
    for p, o in zip(ps, outs):
        assert_reference_logprobs(reference_model, p, o, 2)


def test_a_stop_token_cuts_the_logprobs_with_the_tokens(llama_pair, reference_model):
    ps = prompts(3)
    first = run_local(config(llama_pair, "draft"), ps, SamplingParams(max_tokens=MAX_NEW, temperature=0.0))[0]
    stops = [o.token_ids[5] for o in first]
    params = [SamplingParams(max_tokens=MAX_NEW, temperature=0.0, stop_token_ids=[s], logprobs=1) for s in stops]
    outs, _ = run_local(config(llama_pair, "draft"), ps, params)
    for p, o, s in zip(ps, outs, stops):
        assert o.finish_reason == "stop" and o.token_ids[-1] == s and len(o.token_ids) <= 6
        assert_reference_logprobs(reference_model, p, o, 1)


def test_stream_deltas_carry_the_new_tokens_logprobs(llama_pair, reference_model):
    drv = DriverCore(config(llama_pair, "draft").replace(layout="colocated"))
    p = prompts()[3]
    try:
        (rid,) = drv.submit([p], [SamplingParams(max_tokens=MAX_NEW, temperature=0.0, logprobs=2)]).request_ids
        deltas = []
        while not (deltas and deltas[-1].finished):
            d = drv.poll(rid, timeout=60)
            if d is not None:
                deltas.append(d)
    finally:
        drv.shutdown()
    assert all(len(d.logprobs) == len(d.token_ids) for d in deltas)
    whole = deltas[-1]
    whole.token_ids = [t for d in deltas for t in d.token_ids]
    whole.logprobs = [x for d in deltas for x in d.logprobs]
    assert len(whole.token_ids) == MAX_NEW
    assert_reference_logprobs(reference_model, p, whole, 2)


def test_logprobs_through_bucketed_steps(llama_pair, reference_model, monkeypatch):
    """The CUDA graph path, run uncaptured (as test_step_graphs does): the graphs end in
    hidden states and the logits come from the same eager head, so logprobs need nothing
    of their own there."""
    monkeypatch.setattr(step_graphs, "available", lambda device: True)
    replays = []
    run = step_graphs.StepGraphs.run

    def spy(self, *a):
        out = run(self, *a)
        replays.append(out is not None)
        return out

    monkeypatch.setattr(step_graphs.StepGraphs, "run", spy)
    ps, params = prompts(3), [SamplingParams(max_tokens=MAX_NEW, temperature=0.0, logprobs=4)] * 3
    outs, _ = run_local(config(llama_pair, "draft"), ps, params)
    assert any(replays)
    for p, o in zip(ps, outs):
        assert_reference_logprobs(reference_model, p, o, 4)
