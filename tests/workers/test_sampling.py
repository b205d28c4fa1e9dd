"""Sampling math against independent references: transformers' own logits warpers,
a chi-square test of inverse-CDF sampling, and KS / correlation tests of the keyed uniforms."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from specray.workers.sampling import (
    STREAM_ACCEPT,
    STREAM_DRAFT,
    STREAM_TARGET,
    keyed_uniform,
    logits_to_probs,
    sample_from_probs,
)


def hf_probs(logits: torch.Tensor, temperature: list[float], top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Reference: HF's warpers in HF's order (temperature -> top-k -> top-p), one row at a time."""
    out = []
    for row, t, k, p in zip(logits, temperature, top_k, top_p):
        scores = row.unsqueeze(0).float()
        scores = TemperatureLogitsWarper(float(t) if t > 0 else 1.0)(None, scores)
        if k > 0:
            scores = TopKLogitsWarper(int(k))(None, scores)
        scores = TopPLogitsWarper(float(p))(None, scores)   # 1.0 (off) keeps everything
        out.append(torch.softmax(scores, dim=-1)[0])
    return torch.stack(out)


def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    counts = counts.double()
    expected = probs.double() / probs.double().sum() * counts.sum()
    return float(stats.chisquare(counts.numpy(), expected.numpy()).pvalue)


# -- logits_to_probs -----------------------------------------------------------------------

@pytest.mark.parametrize("vocab", [7, 50])
def test_logits_to_probs_matches_hf_warpers(vocab):
    g = torch.Generator().manual_seed(vocab)
    m = 96
    logits = torch.randn(m, vocab, generator=g) * 3
    temps = [0.0, 0.3, 0.7, 1.0, 1.6, 3.0]
    ks = [0, 1, 2, 5, vocab - 1, vocab, vocab + 10]
    ps = [1.0, 0.95, 0.8, 0.5, 0.2, 0.01]
    temperature = [temps[i % len(temps)] for i in range(m)]
    top_k = [ks[(i // 2) % len(ks)] for i in range(m)]
    top_p = [ps[(i // 3) % len(ps)] for i in range(m)]
    ours = logits_to_probs(logits, torch.tensor(temperature), top_k, top_p)
    ref = hf_probs(logits, temperature, top_k, top_p)
    assert ours.dtype == torch.float32 and ours.shape == (m, vocab)
    torch.testing.assert_close(ours, ref, atol=1e-6, rtol=0)
    # Same support exactly (a filtered token has probability exactly 0) where top-p filters;
    # rows with top-p off are covered by test_top_p_off_row_keeps_its_tail_in_a_filtering_batch.
    filt = torch.tensor(top_p) < 1
    assert torch.equal(ours[filt] > 0, ref[filt] > 0)


def test_logits_to_probs_single_knobs_and_off_paths():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 30, generator=g) * 2
    temperature = [0.0, 0.5, 1.0, 2.0, 0.0, 1.0]
    t = torch.tensor(temperature)
    # Only top-k (top_p None), only top-p (top_k None), nothing at all (no sort path).
    cases = [([3, 0, 1, 30, 7, 0], None), (None, [0.3, 1.0, 0.9, 0.5, 1.0, 0.7]), (None, None),
             ([0] * 6, [1.0] * 6)]
    for top_k, top_p in cases:
        ours = logits_to_probs(logits, t, top_k, top_p)
        ref = hf_probs(logits, temperature, top_k or [0] * 6, top_p or [1.0] * 6)
        torch.testing.assert_close(ours, ref, atol=1e-6, rtol=0)
        if top_p is None:
            assert torch.equal(ours > 0, ref > 0)


def test_top_p_off_row_keeps_its_tail_in_a_filtering_batch():
    # Row 0 asks for nothing (top_k 0, top_p 1.0); row 1 filters, so the batch takes the sort path.
    logits = torch.tensor([[8.0, 0.0, -4.0, -9.0, -12.0], [1.0, 2.0, 3.0, 4.0, 5.0]])
    temperature = torch.tensor([1.0, 1.0])
    alone = logits_to_probs(logits[:1], temperature[:1], [0], [1.0])
    assert bool((alone > 0).all())                       # unfiltered path: full support
    batched = logits_to_probs(logits, temperature, [0, 0], [1.0, 0.5])
    ref = hf_probs(logits, [1.0, 1.0], [0, 0], [1.0, 0.5])
    assert torch.equal(batched[0] > 0, ref[0] > 0)       # HF keeps every token of row 0
    assert torch.equal(batched[0] > 0, alone[0] > 0)     # a request's probs do not depend on its batch


def test_top_k_keeps_ties_like_hf():
    # Ties are common once logits come from bf16/fp16 models.
    logits = torch.tensor([[3.0, 2.0, 2.0, 1.0], [1.0, 1.0, 1.0, 0.0]])
    ours = logits_to_probs(logits, torch.tensor([1.0, 1.0]), [2, 1], None)
    ref = hf_probs(logits, [1.0, 1.0], [2, 1], [1.0, 1.0])
    assert torch.equal(ours > 0, ref > 0)


def test_top_p_keeps_smallest_prefix_reaching_mass():
    probs = torch.tensor([[0.1, 0.5, 0.25, 0.15]])
    logits = probs.log()
    out = logits_to_probs(logits, torch.tensor([1.0]), None, [0.7])
    # 0.5 alone is < 0.7, 0.5 + 0.25 reaches it: keep exactly tokens 1 and 2.
    torch.testing.assert_close(out, torch.tensor([[0.0, 0.5 / 0.75, 0.25 / 0.75, 0.0]]), atol=1e-6, rtol=0)
    # top-p over the top-k survivors: top-2 = {1, 2} renormalised to (2/3, 1/3); 0.6 keeps only token 1.
    out = logits_to_probs(logits, torch.tensor([1.0]), [2], [0.6])
    torch.testing.assert_close(out, torch.tensor([[0.0, 1.0, 0.0, 0.0]]), atol=1e-6, rtol=0)


# -- sample_from_probs ---------------------------------------------------------------------

def test_sample_from_probs_never_returns_zero_probability_tokens():
    g = torch.Generator().manual_seed(0)
    m, vocab = 4000, 12
    probs = torch.rand(m, vocab, generator=g)
    probs[torch.rand(m, vocab, generator=g) < 0.6] = 0.0
    probs[:, 0] = 0.0                       # leading zero
    probs[:, -1] = 0.0                      # trailing zero
    probs[torch.arange(m), torch.randint(1, vocab - 1, (m,), generator=g)] += 0.1   # every row has mass
    probs[::2] *= 7.5                       # need not be normalised
    u = torch.rand(m, generator=g, dtype=torch.float64)
    edges = torch.tensor([0.0, 1e-300, 0.5, 1.0 - 2.0**-53, 1.0 - 2.0**-40], dtype=torch.float64)
    u[:len(edges)] = edges
    u[len(edges):2 * len(edges)] = edges
    tok = sample_from_probs(probs, u)
    assert tok.dtype == torch.int64 and tok.shape == (m,)
    assert bool((probs[torch.arange(m), tok] > 0).all())


def test_sample_from_probs_single_token_rows():
    probs = torch.zeros(5, 9)
    probs[torch.arange(5), torch.tensor([0, 3, 8, 8, 4])] = torch.tensor([1.0, 0.3, 2.0, 1e-30, 1.0])
    u = torch.tensor([0.0, 0.999999, 0.5, 1.0 - 2.0**-53, 0.25], dtype=torch.float64)
    assert sample_from_probs(probs, u).tolist() == [0, 3, 8, 8, 4]


def test_sample_from_probs_matches_distribution():
    g = torch.Generator().manual_seed(1)
    p = torch.tensor([0.02, 0.3, 0.0, 0.18, 0.05, 0.25, 0.2])
    n = 100_000
    u = torch.rand(n, generator=g, dtype=torch.float64)
    tok = sample_from_probs(p.expand(n, -1), u)
    counts = torch.bincount(tok, minlength=p.numel()).double()
    assert counts[2] == 0
    keep = p > 0
    assert chi2_pvalue(counts[keep], p[keep]) > 1e-3
    # ... and the test has power: a slightly different distribution is rejected.
    off = p.clone()
    off[1], off[5] = 0.28, 0.27
    assert chi2_pvalue(counts[keep], off[keep]) < 1e-6


# -- keyed_uniform -------------------------------------------------------------------------

def test_keyed_uniform_range_dtype_and_broadcast():
    seeds = torch.tensor([[0], [1], [-1], [2**63 - 1], [-(2**63)], [123456789012345]])
    pos = torch.arange(50).unsqueeze(0) + torch.tensor([[0], [10], [2**31], [2**32 + 5], [0], [7]])
    u = keyed_uniform(seeds, pos, STREAM_DRAFT)
    assert u.dtype == torch.float64 and u.shape == (6, 50)
    assert bool((u >= 0).all()) and bool((u < 1).all())


def test_keyed_uniform_is_deterministic_and_keyed():
    seeds = torch.tensor([7, 7, 8, 7])
    pos = torch.tensor([3, 4, 3, 3])
    a = keyed_uniform(seeds, pos, STREAM_ACCEPT)
    b = keyed_uniform(seeds.clone(), pos.clone(), STREAM_ACCEPT)
    assert torch.equal(a, b)
    # Same key in another row of the batch: same value (batch independence).
    assert a[0] == a[3]
    assert a[0] != a[1]                                              # position
    assert a[0] != a[2]                                              # seed
    assert a[0] != keyed_uniform(seeds, pos, STREAM_TARGET)[0]       # stream
    assert a[0] != keyed_uniform(seeds, pos, STREAM_DRAFT)[0]
    # Scalars broadcast like tensors.
    assert keyed_uniform(torch.tensor(7), torch.tensor(3), STREAM_ACCEPT) == a[0]


def test_keyed_uniform_distinct_values():
    pos = torch.arange(100_000)
    u = keyed_uniform(torch.tensor(42), pos, STREAM_TARGET)
    assert torch.unique(u).numel() == u.numel()


@pytest.mark.parametrize("stream", [STREAM_DRAFT, STREAM_ACCEPT, STREAM_TARGET])
def test_keyed_uniform_is_uniform_over_positions_and_seeds(stream):
    n = 100_000
    over_pos = keyed_uniform(torch.tensor(12345), torch.arange(n), stream).numpy()
    over_seed = keyed_uniform(torch.arange(n), torch.tensor(0), stream).numpy()
    for u in (over_pos, over_seed):
        assert stats.kstest(u, "uniform").pvalue > 1e-3
        # Lag-1 independence of consecutive keys.
        assert abs(np.corrcoef(u[:-1], u[1:])[0, 1]) < 0.02
    # Low bits too: the 53-bit value's fractional tail is uniform.
    tail = (over_pos * 2.0**30) % 1.0
    assert stats.kstest(tail, "uniform").pvalue > 1e-3


def test_keyed_uniform_streams_are_independent():
    n = 100_000
    seeds = torch.arange(n) // 100
    pos = torch.arange(n) % 100
    d, a, t = (keyed_uniform(seeds, pos, s).numpy() for s in (STREAM_DRAFT, STREAM_ACCEPT, STREAM_TARGET))
    for x, y in ((d, a), (d, t), (a, t)):
        assert abs(np.corrcoef(x, y)[0, 1]) < 0.02
        # Joint uniformity on a 10x10 grid (catches dependence a correlation misses).
        hist, _, _ = np.histogram2d(x, y, bins=10, range=[[0, 1], [0, 1]])
        assert stats.chisquare(hist.ravel()).pvalue > 1e-3
