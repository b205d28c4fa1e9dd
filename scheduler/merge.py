"""Merge draft proposals from any number of shards into one target batch.

The seed's ``_merge_outputs`` scattered one shard's ``[m, k]`` proposals into an
``[n, k]`` batch where skipped sequences carry ``-1``; here any number of shards, each
with its own per-sequence lengths, land in the target batch's order::

    target batch:   s0  s1  s2  s3          shard A: s2 (len 2)   shard B: s0 (len 3)
    merged tokens:  [a b c] [-1 -1 -1] [x y -1] [-1 -1 -1]
    proposal_lens:  3        0          2        0
    draft_rows:     1        -1         0        -1     (row in A's probs ++ B's probs)

``draft_rows`` indexes the concatenation of the shards' probability tensors in shard
order, and is -1 for sequences without proposals or whose shard sent no probabilities
(deterministic proposals such as n-gram lookups, which the sampler treats as one-hot).
With several target workers a shard also holds other workers' sequences: they are
skipped, but their rows still count, since the target receives whole probability tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specray.scheduler.messages import Proposals, StepPlan


@dataclass
class MergedProposals:
    token_ids: list[int]       # [n * k], -1 padded
    proposal_lens: list[int]   # [n]
    draft_rows: list[int]      # [n]
    # seq id -> the draft's probability of each of its proposals, where a draft reported them
    confidence: dict[int, list[float]] = field(default_factory=dict)


def merge_proposals(seq_ids: list[int], k: int, shards: list[Proposals]) -> MergedProposals:
    n = len(seq_ids)
    tokens = [-1] * (n * k)
    lens = [0] * n
    rows = [-1] * n
    where = {sid: i for i, sid in enumerate(seq_ids)}
    row_offset = 0
    confidence: dict[int, list[float]] = {}
    for shard in shards:
        if shard.k != k:
            raise ValueError(f"shard proposed with k={shard.k}, the step uses k={k}")
        for r, sid in enumerate(shard.seq_ids):
            i = where.get(sid)
            if i is None:
                continue
            length = shard.proposal_lens[r]
            lens[i] = length
            tokens[i * k:i * k + length] = shard.token_ids[r * k:r * k + length]
            if shard.confidence and length:
                confidence[sid] = shard.confidence[r * k:r * k + length]
            if shard.has_probs and length:
                rows[i] = row_offset + (shard.prob_rows[r] if shard.prob_rows else r)
        if shard.has_probs:
            row_offset += shard.num_prob_rows or len(shard.seq_ids)
    return MergedProposals(tokens, lens, rows, confidence)


def attach(plan: StepPlan, merged: MergedProposals) -> None:
    """The merged proposals become the target plan's (what its worker verifies)."""
    plan.proposal_token_ids = merged.token_ids
    plan.proposal_lens = merged.proposal_lens
    plan.draft_rows = merged.draft_rows
