"""Sampling math as small pure functions over whole batches.

Randomness is counter-based: the uniform that decides token ``position`` of a request
is a hash of (request seed, position, stream). It needs no generator state, so a
request's samples do not depend on which batch it shares, on preemption, or on a worker
restart, and it is computed on whatever device the logits live on without a host sync.
"""

from __future__ import annotations

import torch

# Streams keep the draws of one position independent of each other.
STREAM_DRAFT = 1      # the draft's proposal
STREAM_ACCEPT = 2     # the accept/reject coin
STREAM_TARGET = 3     # the recovered or bonus token

_M32 = 0xFFFFFFFF
LOGPROB_FLOOR = -9999.0


def _mix32(x: torch.Tensor) -> torch.Tensor:
    # A 32-bit avalanche hash on int64 lanes; products stay below 2**59, so no overflow.
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _M32
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _M32
    return (x >> 16) ^ x


def keyed_uniform(seeds: torch.Tensor, positions: torch.Tensor, stream: int) -> torch.Tensor:
    """Uniforms in [0, 1) with 53 random bits, one per (seed, position) pair.

    seeds, positions: int64, broadcastable; returns float64 of the broadcast shape.
    """
    seeds, positions = torch.broadcast_tensors(seeds.long(), positions.long())
    h = _mix32((seeds >> 32) & _M32 ^ 0x2545F491)
    h = _mix32(h ^ (seeds & _M32))
    h = _mix32(h ^ (positions & _M32))
    h1 = _mix32(h ^ (stream * 0x9E3779B1 & _M32))
    h2 = _mix32(h1 ^ 0x68E31DA4)
    bits = h1 * (1 << 21) + (h2 >> 11)
    return bits.double() * (1.0 / (1 << 53))


def logits_to_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: list[int] | None = None,
                    top_p: list[float] | None = None) -> torch.Tensor:
    """Temperature, then top-k, then top-p (over the top-k survivors), then softmax.

    logits: [rows, V]; temperature: [rows] (rows at 0 are treated as 1: greedy rows never use
    these probabilities); top_k / top_p: per row on the host (0 / 1.0 = off), so the
    sort is skipped when no row filters. Returns float32 [rows, V].
    """
    logits = logits.float()
    t = torch.where(temperature > 0, temperature, torch.ones_like(temperature)).to(logits)
    logits = logits / t.unsqueeze(-1)
    need_k = top_k is not None and any(x > 0 for x in top_k)
    need_p = top_p is not None and any(p < 1.0 for p in top_p)
    if need_k or need_p:
        logits = _filter_top_k_top_p(logits, top_k if need_k else None, top_p if need_p else None)
    return torch.softmax(logits, dim=-1)


def _filter_top_k_top_p(logits: torch.Tensor, top_k: list[int] | None, top_p: list[float] | None) -> torch.Tensor:
    rows, vocab = logits.shape
    sorted_logits, order = logits.sort(dim=-1, descending=True)          # [rows, V]
    ranks = torch.arange(vocab, device=logits.device).expand(rows, vocab)
    drop = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if top_k is not None:
        keep = torch.tensor([min(x, vocab) if x > 0 else vocab for x in top_k], device=logits.device)
        # Ties with the top_k-th value survive, as in transformers and vLLM.
        kth = sorted_logits.gather(-1, (keep - 1).unsqueeze(-1))
        drop |= sorted_logits < kth
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    if top_p is not None:
        p = torch.tensor(top_p, device=logits.device, dtype=torch.float32)
        probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs                       # exclusive cumsum
        # Keep the smallest prefix whose mass reaches top_p; the first token always stays,
        # and rows with top_p = 1 keep everything (float rounding must not cut their tail).
        drop |= (mass_before >= p.unsqueeze(-1)) & (ranks > 0) & (p < 1.0).unsqueeze(-1)
    filtered = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, filtered)


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, num_top: int):
    """Raw logprobs: the log-softmax of the logits as they are, before temperature, top-k
    or top-p (what plain decoding reports for a token, however it was sampled).

    logits: [..., V]; token_ids: [...] valid ids. Returns the tokens' logprobs [...] and the
    ``num_top`` largest logprobs and their ids [..., num_top], largest first. float32.
    """
    # A token structured output forbids has -inf; reported as -9999.0 (vLLM's floor), so
    # every figure is finite (JSON has no infinity).
    logp = torch.log_softmax(logits.float(), dim=-1).clamp(min=LOGPROB_FLOOR)
    chosen = logp.gather(-1, token_ids.long().unsqueeze(-1)).squeeze(-1)
    top_lp, top_ids = logp.topk(num_top, dim=-1)
    return chosen, top_lp, top_ids


def sample_from_probs(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling. probs: [rows, V] (need not be normalised), u: [rows] in [0, 1).
    Returns int64 [rows]; a token of zero probability is never returned."""
    cdf = probs.double().cumsum(dim=-1)                                   # [rows, V]
    target = (u.double() * cdf[:, -1]).unsqueeze(-1)                      # [rows, 1]
    idx = torch.searchsorted(cdf, target, right=True).squeeze(-1)
    return idx.clamp_(max=probs.shape[-1] - 1)
