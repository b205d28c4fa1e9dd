"""Speculative sampling is lossless: the emitted tokens follow the target's distribution.

On an 8-token vocabulary the exact joint distribution of the first two generated tokens
is computed from the target's own logits with transformers' warpers; thousands of
requests through the runtime must match it (chi-square), while the draft's distribution,
which is far from it, must be rejected by the same test.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from scipy.stats import chisquare
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper

from specray.runtime.config import RuntimeConfig
from specray.runtime.driver.core import DriverCore
from specray.scheduler.sampling_params import SamplingParams

V = 8
PROMPT = [3, 1, 4, 1, 5]
N = 6000


@pytest.fixture(scope="module")
def tiny_vocab_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_vocab")
    dirs = []
    for name, seed, scale in (("target", 0, 4.0), ("draft", 7, 3.0)):
        torch.manual_seed(seed)
        cfg = LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                          num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                          bos_token_id=None, eos_token_id=None, pad_token_id=None)
        m = LlamaForCausalLM(cfg)
        with torch.no_grad():
            m.lm_head.weight.mul_(scale)
        m.save_pretrained(root / name)
        dirs.append(str(root / name))
    return dirs


def exact_joint(model_dir: str, temperature: float, top_k: int = 0, depth: int = 2) -> dict[tuple, float]:
    """The exact distribution of the first ``depth`` generated tokens, from the model's own
    logits through transformers' warpers."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    warpers = [TemperatureLogitsWarper(temperature)] + ([TopKLogitsWarper(top_k)] if top_k else [])

    def dist(ids):
        with torch.no_grad():
            x = torch.tensor([ids])
            logits = model(x, attention_mask=torch.ones_like(x)).logits[:, -1].double()
        for w in warpers:
            logits = w(x, logits)
        return torch.softmax(logits, -1)[0].tolist()

    joint = {}

    def walk(prefix: list[int], p: float) -> None:
        if len(prefix) == depth:
            joint[tuple(prefix)] = p
            return
        for a, pa in enumerate(dist(PROMPT + prefix)):
            if pa > 0:
                walk(prefix + [a], p * pa)

    walk([], 1.0)
    return joint


def sample(cfg: RuntimeConfig, params: SamplingParams, count: int = N, layout: str = "colocated",
           prepare=lambda drv: None) -> tuple[list, dict]:
    """``count`` requests of PROMPT through a driver: their outputs and its metrics."""
    drv = DriverCore(cfg.replace(layout=layout), export_metrics=False)
    try:
        prepare(drv)
        reply = drv.submit([PROMPT] * count, [params] * count)
        assert reply.error is None
        return drv.wait(reply.request_ids, timeout=900), drv.metrics()
    finally:
        drv.shutdown()


def chi2_pvalue(counts: Counter, probs: dict, n: int = N) -> float:
    cells = sorted(probs, key=lambda c: probs[c])
    obs, exp, acc_o, acc_e = [], [], 0, 0.0
    for c in cells:   # pool the rare cells so every expected count is >= 5
        acc_o += counts.get(c, 0)
        acc_e += probs[c] * n
        if acc_e >= 5:
            obs.append(acc_o)
            exp.append(acc_e)
            acc_o, acc_e = 0, 0.0
    if acc_e:
        obs[-1] += acc_o
        exp[-1] += acc_e
    stray = sum(v for c, v in counts.items() if c not in probs)
    if stray:
        return 0.0
    total = sum(exp)
    return float(chisquare(obs, [e * sum(obs) / total for e in exp]).pvalue)


@pytest.mark.parametrize("temperature,top_k", [(1.0, 0), (0.8, 3)])
def test_first_two_tokens_follow_the_target(tiny_vocab_pair, temperature, top_k):
    target, draft = tiny_vocab_pair
    cfg = RuntimeConfig(target=target, draft=draft, num_speculative_tokens=2, block_size=4, device="cpu",
                        dtype="float32", max_num_seqs=1024, max_pending=N, seed=11)
    outs, m = sample(cfg, SamplingParams(max_tokens=2, temperature=temperature, top_k=top_k))
    counts = Counter(tuple(o.token_ids) for o in outs)
    p_target = exact_joint(target, temperature, top_k)
    p_draft = exact_joint(draft, temperature, top_k)
    # Both the accept and the resample paths were taken many times.
    assert 0.1 < m["acceptance_rate"] < 0.9
    assert chi2_pvalue(counts, p_target) > 1e-3
    # Power: the draft's own distribution is far from the target's, and the test sees it.
    assert chi2_pvalue(counts, p_draft) < 1e-6
    if top_k:
        allowed = {c for c, p in p_target.items() if p > 0}
        assert set(counts) <= allowed


@pytest.mark.parametrize("proposer", ["suffix", "draft+suffix"])
def test_suffix_proposals_keep_the_target_distribution(tiny_vocab_pair, proposer):
    """Suffix decoding proposes deterministically (a one-hot draft distribution) what the
    requests finished before emitted most often; with the draft beside it, each sequence's
    verified proposal is the one expected to be accepted longer. Either way the first two
    tokens follow the target. Waves of 256: later waves propose from the earlier ones."""
    target, draft = tiny_vocab_pair
    cfg = RuntimeConfig(target=target, draft=draft if "draft" in proposer else None, proposer=proposer,
                        num_speculative_tokens=2, block_size=4, device="cpu", dtype="float32", max_num_seqs=256,
                        max_pending=N, seed=14, suffix_min_prob=0.01)
    outs, m = sample(cfg, SamplingParams(max_tokens=3, temperature=1.0))
    counts = Counter(tuple(o.token_ids[:2]) for o in outs)
    assert m["num_draft_tokens"] > N                    # most requests proposed (two tokens)
    assert 0.1 < m["acceptance_rate"] < 0.9             # accepted and rejected, many times
    assert m["suffix_cached_requests"] == cfg.speculation.suffix_cache_requests
    assert chi2_pvalue(counts, exact_joint(target, 1.0, 0)) > 1e-3
    if "draft" in proposer:
        assert chi2_pvalue(counts, exact_joint(draft, 1.0, 0)) < 1e-6


@pytest.fixture(scope="module")
def padded_drafts(tiny_vocab_pair, tmp_path_factory):
    """The tiny pair's draft padded two other ways: cut to its first 6 rows (the target's
    tokens 6 and 7 are then ones it can never propose), and grown to 10, the two extra
    head rows three times rows 0 and 1 (unmasked, it would mostly propose them)."""
    _, draft = tiny_vocab_pair
    root = tmp_path_factory.mktemp("padded")
    out = {}
    for dv in (6, 10):
        model = AutoModelForCausalLM.from_pretrained(draft, dtype=torch.float32)
        sd = model.state_dict()
        for name in ("model.embed_tokens.weight", "lm_head.weight"):
            w = sd[name]
            scale = 3.0 if name == "lm_head.weight" else 1.0
            sd[name] = w[:dv].clone() if dv < V else torch.cat([w, w[:dv - V] * scale])
        model.config.vocab_size = dv
        grown = LlamaForCausalLM(model.config)
        grown.load_state_dict(sd)
        grown.save_pretrained(root / str(dv))
        out[dv] = str(root / str(dv))
    return out


@pytest.mark.parametrize("dv", [6, 10])
def test_a_draft_padded_another_way_keeps_the_target_distribution(tiny_vocab_pair, padded_drafts, dv):
    """The draft proposes only ids the target scores, its probabilities zero past its own
    rows (6) or cut to the target's (10): the first two tokens still follow the target."""
    target, _ = tiny_vocab_pair
    cfg = RuntimeConfig(target=target, draft=padded_drafts[dv], num_speculative_tokens=2, block_size=4,
                        device="cpu", dtype="float32", max_num_seqs=1024, max_pending=N, seed=13)
    outs, m = sample(cfg, SamplingParams(max_tokens=2, temperature=1.0))
    counts = Counter(tuple(o.token_ids) for o in outs)
    assert 0.1 < m["acceptance_rate"] < 0.9
    assert chi2_pvalue(counts, exact_joint(target, 1.0, 0)) > 1e-3
    if dv < V:
        # Tokens the draft has no row for come from the residual (and the bonus) alone.
        assert any(a >= dv or b >= dv for a, b in counts)


def test_pre_drafted_windows_keep_the_target_distribution_through_actors(tiny_vocab_pair, ray_module):
    """Overlap through actors: with one token proposed per step and four tokens per
    request, a request whose first window is all accepted and whose bonus the draft
    guessed takes its second window from the pre-draft, so the third token is drawn
    through that path; the first three tokens must still follow the target. One request
    at a time (a batch takes pre-drafts only when all of it holds), so fewer requests than
    the other tests: at this size the draft's distribution is still rejected by far."""
    n = N // 3
    target, draft = tiny_vocab_pair
    cfg = RuntimeConfig(target=target, draft=draft, num_speculative_tokens=1, block_size=4, device="cpu",
                        dtype="float32", max_num_seqs=1, max_pending=n, seed=13, overlap=True)

    def always_predraft(drv):
        drv.engine.book.min_use = 0.0

    outs, m = sample(cfg, SamplingParams(max_tokens=4, temperature=1.0), n, "actors", always_predraft)
    counts = Counter(tuple(o.token_ids[:3]) for o in outs)
    assert m["num_predraft_windows_used"] > n // 20
    assert chi2_pvalue(counts, exact_joint(target, 1.0, depth=3), n) > 1e-3
    assert chi2_pvalue(counts, exact_joint(draft, 1.0, depth=3), n) < 1e-6


def test_two_groups_in_flight_keep_the_target_distribution(tiny_vocab_pair):
    """While the target verifies one group the draft proposes for the other
    (``GroupEngine``, in process: the order of calls is what groups change)."""
    from specray.runtime.engine.step_groups import GroupEngine

    target, draft = tiny_vocab_pair
    cfg = RuntimeConfig(target=target, draft=draft, num_speculative_tokens=1, block_size=4, device="cpu",
                        dtype="float32", max_num_seqs=1024, max_pending=N, seed=17)

    def groups(drv):
        drv.engine = GroupEngine(drv.scheduler, drv.engine.verifiers, drv.engine.proposer)

    outs, m = sample(cfg, SamplingParams(max_tokens=2, temperature=1.0), prepare=groups)
    counts = Counter(tuple(o.token_ids) for o in outs)
    assert m["num_group_steps"] > 0 and 0.1 < m["acceptance_rate"] < 0.9
    assert chi2_pvalue(counts, exact_joint(target, 1.0)) > 1e-3
    assert chi2_pvalue(counts, exact_joint(draft, 1.0)) < 1e-6
