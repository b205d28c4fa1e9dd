"""Merge draft proposals from any number of shards into one target plan.

Each shard's proposals are scattered into an ``[n, k]`` batch in the target plan's
order, where sequences without proposals carry ``-1``; any number of shards, each with
its own per-sequence lengths, land in one batch::

    target plan:    s0  s1  s2  s3          shard A: s2 (len 2)   shard B: s0 (len 3)
    proposals:      [a b c] [-1 -1 -1] [x y -1] [-1 -1 -1]
    proposal_lens:  3        0          2        0
    draft_rows:     1        -1         0        -1     (row in A's probs ++ B's probs)

``draft_rows`` indexes the concatenation of the shards' probability tensors in shard
order, and is -1 for sequences without proposals or whose shard sent no probabilities
for them (deterministic proposals such as n-gram lookups, which the sampler treats as
one-hot; a row whose ``Proposals.prob_rows`` entry is -1), and ``IN_TARGET_ROW`` where
the target worker makes the proposals itself.
With several target workers a shard also holds other workers' sequences: they are
skipped, but their rows still count, since the target receives whole probability tensors.
"""

from __future__ import annotations

from dataclasses import replace

from specray.scheduler.messages import IN_TARGET_ROW, Proposals, StepPlan


def merge_proposals(plan: StepPlan, shards: list[Proposals], picks: dict[int, int] | None = None) -> StepPlan:
    """The target ``plan`` with the shards' proposals for its sequences, as a new plan:
    its ``proposal_lens`` become what the drafts made (0 where no shard proposed).
    ``picks`` (sequence id -> shard index, ``proposal_choice.pick_shards``): where a
    sequence is in several shards, the one whose proposal is verified."""
    n, width = plan.num_seqs, plan.width
    tokens = [-1] * (n * width)
    lens = [0] * n
    rows = [-1] * n
    where = {sid: i for i, sid in enumerate(plan.seq_ids)}
    row_offset = 0
    for s, shard in enumerate(shards):
        if shard.width != width:
            raise ValueError(f"shard proposed with width {shard.width}, the step's is {width}")
        for r, sid in enumerate(shard.seq_ids):
            i = where.get(sid)
            if i is None or (picks is not None and picks.get(sid, s) != s):
                continue
            length = shard.proposal_lens[r]
            lens[i] = length
            tokens[i * width:i * width + length] = shard.token_ids[r * width:r * width + length]
            if length and (shard.has_probs or shard.prob_rows):
                row = shard.prob_rows[r] if shard.prob_rows else r
                if row == IN_TARGET_ROW:
                    rows[i] = IN_TARGET_ROW          # the target makes them, in its verify call
                elif row >= 0 and shard.has_probs:
                    rows[i] = row_offset + row
        if shard.has_probs:
            row_offset += shard.num_prob_rows or len(shard.seq_ids)
    return replace(plan, proposal_token_ids=tokens, proposal_lens=lens, draft_rows=rows)
