"""Lossless verification of draft proposals.

Per sequence, with ``m`` its ``proposal_len`` (``specray.scheduler``'s glossary):
proposals ``x_1..x_m``, target distributions ``p_0..p_m`` at the m + 1 scored positions,
draft distributions ``q_0..q_{m-1}``. The accepted tokens are the longest prefix of
proposals the target keeps; then comes the target's own token: at the first rejected
position j a sample of ``norm(max(0, p_j - q_j))`` (greedy: the target's argmax), or, when
all m are accepted, the bonus token, a sample of ``p_m``. Every step therefore emits
accepted + 1 tokens. Proposal ``x_j`` is accepted with
probability ``min(1, p(x_j) / q(x_j))``, which makes the emitted tokens distributed
exactly as the target's own samples. A deterministic proposal (n-gram) is a one-hot q.

``random_verify`` works on the whole batch at once on the device, over grids of the
step's ``width``; its outputs are ``[n, width + 1]`` with ``-1`` past the emitted tokens,
plus ``num_emitted [n]``.
``greedy_accept`` reads the target's argmax grid on the host.
"""

from __future__ import annotations

import torch

from specray.workers.sampling import sample_from_probs


def greedy_accept(target_argmax: list[int], proposal_ids: list[int], proposal_lens: list[int],
                  width: int) -> list[list[int]]:
    """Greedy verification on the host. ``target_argmax``: the target's argmax at each
    sequence's width + 1 scored positions, flat ``[n * (width+1)]``; ``proposal_ids``: flat
    ``[n * width]``, -1 padded (empty when nothing was proposed). Returns each sequence's
    emitted tokens: its accepted proposals (which equal the target's argmax there) and the
    target's token at the first mismatch, or the bonus token when all match."""
    w1 = width + 1
    emitted = []
    for i, proposal_len in enumerate(proposal_lens):
        target = target_argmax[i * w1:i * w1 + proposal_len + 1]
        j = 0
        while j < proposal_len and proposal_ids[i * width + j] == target[j]:
            j += 1
        emitted.append(target[:j + 1])
    return emitted


def random_verify(target_probs: torch.Tensor, draft_ids: torch.Tensor, draft_probs: torch.Tensor | None,
                  has_draft_probs: torch.Tensor, proposal_lens: torch.Tensor,
                  accept_u: torch.Tensor, sample_u: torch.Tensor):
    """target_probs: [n, w+1, V] (w: the step's width); draft_ids: [n, w]; draft_probs: [n, w, V] or None
    (rows with ``has_draft_probs`` False are one-hot at their proposal);
    accept_u: [n, w]; sample_u: [n, w+1] uniforms in [0, 1)."""
    n, w1, vocab = target_probs.shape
    w = w1 - 1
    dev = target_probs.device
    rows = torch.arange(n, device=dev)
    valid = torch.arange(w, device=dev) < proposal_lens.unsqueeze(-1)                 # [n, w]
    ids = draft_ids.clamp(min=0)
    one_hot = torch.nn.functional.one_hot(ids, vocab).to(target_probs.dtype)         # [n, w, V]
    if draft_probs is None:
        q = one_hot
    else:
        q = torch.where(has_draft_probs.view(n, 1, 1), draft_probs.to(target_probs.dtype), one_hot)
    p_x = target_probs[:, :w].gather(-1, ids.unsqueeze(-1)).squeeze(-1)               # [n, w]
    q_x = q.gather(-1, ids.unsqueeze(-1)).squeeze(-1)                                 # [n, w]
    # u < p/q, written without the division; strict so a token with p = 0 is never kept.
    accept = (accept_u.to(p_x.dtype) * q_x < p_x) & valid
    num_accepted = accept.long().cumprod(dim=-1).sum(dim=-1)                          # [n]

    # The one distribution each row samples from: residual at the first rejection,
    # the target itself for the bonus position.
    at = num_accepted.clamp(max=max(w - 1, 0))
    rejected = num_accepted < proposal_lens
    if w > 0:
        residual = (target_probs[rows, at] - q[rows, at]).clamp_(min=0)             # [n, V]
        # p == q everywhere leaves no residual, but then nothing is ever rejected.
        empty = residual.sum(-1, keepdim=True) <= 0
        residual = torch.where(empty, target_probs[rows, at], residual)
        final = torch.where(rejected.unsqueeze(-1), residual, target_probs[rows, num_accepted])
    else:
        final = target_probs[:, 0]
    token = sample_from_probs(final, sample_u[rows, num_accepted])                    # [n]

    j = torch.arange(w1, device=dev)
    padded_ids = torch.cat([draft_ids, draft_ids.new_full((n, 1), -1)], dim=1)        # [n, w+1]
    out = torch.where(j < num_accepted.unsqueeze(-1), padded_ids, torch.full_like(padded_ids, -1))
    out[rows, num_accepted] = token
    return out, num_accepted + 1
