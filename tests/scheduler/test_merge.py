"""merge_proposals: shards of any size and order land in the target plan's order, as a
new plan (the one scheduled is left as it was)."""

from __future__ import annotations

import copy
import random
from dataclasses import dataclass

import pytest

from specray.scheduler.merge import merge_proposals as merge_into
from specray.scheduler.messages import Proposals, StepPlan


def shard(k: int, rows: dict[int, list[int]], has_probs: bool = True) -> Proposals:
    """rows: seq_id -> proposed tokens (len <= k), in shard row order."""
    toks: list[int] = []
    for t in rows.values():
        toks.extend(t + [-1] * (k - len(t)))
    return Proposals(step_id=1, width=k, has_probs=has_probs, seq_ids=list(rows),
                     proposal_lens=[len(t) for t in rows.values()], token_ids=toks)


@dataclass
class MergedProposals:
    token_ids: list[int]
    proposal_lens: list[int]
    draft_rows: list[int]


def merge_proposals(seq_ids: list[int], k: int, shards: list[Proposals]) -> MergedProposals:
    """The merge into a target plan of ``seq_ids`` (each planned to propose ``k``), read
    back; the plan handed in must come back unchanged."""
    n = len(seq_ids)
    plan = StepPlan(step_id=1, width=k, seq_ids=list(seq_ids), num_computed=[0] * n, num_new=[1] * n,
                    token_ids=[0] * n, num_slots=[1 + k] * n, proposal_lens=[k] * n, temperature=[0.0] * n,
                    top_k=[0] * n, top_p=[1.0] * n, seeds=[0] * n)
    before = copy.deepcopy(plan)
    merged = merge_into(plan, shards)
    assert plan == before, "the scheduled plan was rewritten"
    merged.validate()
    rest = {f: getattr(merged, f) for f in ("seq_ids", "num_computed", "num_new", "token_ids", "num_slots", "seeds")}
    assert rest == {f: getattr(before, f) for f in rest}
    return MergedProposals(merged.proposal_token_ids, merged.proposal_lens, merged.draft_rows)


def test_docstring_example():
    a, b, c, x, y = 10, 11, 12, 20, 21
    A = shard(3, {2: [x, y]})
    B = shard(3, {0: [a, b, c]})
    m = merge_proposals([0, 1, 2, 3], 3, [A, B])
    assert m == MergedProposals(
        token_ids=[a, b, c, -1, -1, -1, x, y, -1, -1, -1, -1],
        proposal_lens=[3, 0, 2, 0],
        draft_rows=[1, -1, 0, -1])


def test_no_shards_gives_an_empty_proposal_for_everyone():
    m = merge_proposals([5, 6], 2, [])
    assert m == MergedProposals([-1] * 4, [0, 0], [-1, -1])
    assert merge_proposals([], 4, []) == MergedProposals([], [], [])


def test_k_zero():
    m = merge_proposals([1, 2], 0, [shard(0, {2: [], 1: []})])
    assert m == MergedProposals([], [0, 0], [-1, -1])


def test_shard_without_probs_gives_draft_rows_minus_one_and_no_row_offset():
    ngram = shard(2, {7: [1, 2], 9: [3]}, has_probs=False)
    model = shard(2, {8: [4], 6: [5, 6]}, has_probs=True)
    m = merge_proposals([6, 7, 8, 9], 2, [ngram, model])
    assert m.token_ids == [5, 6, 1, 2, 4, -1, 3, -1]
    assert m.proposal_lens == [2, 2, 1, 1]
    # the probs-less shard contributes no rows: the model shard's rows start at 0
    assert m.draft_rows == [1, -1, 0, -1]


def test_row_offsets_accumulate_over_shards_with_probs_including_zero_length_rows():
    s1 = shard(3, {30: [1], 31: []})                  # 2 rows of probs, one unused
    s2 = shard(3, {32: [2, 3]}, has_probs=False)      # no probs: no rows
    s3 = shard(3, {33: [], 34: [4, 5, 6], 35: [7]})   # rows 2, 3, 4
    order = [35, 34, 33, 32, 31, 30]
    m = merge_proposals(order, 3, [s1, s2, s3])
    assert m.proposal_lens == [1, 3, 0, 2, 0, 1]
    assert m.draft_rows == [4, 3, -1, -1, -1, 0]
    assert m.token_ids == [7, -1, -1, 4, 5, 6, -1, -1, -1, 2, 3, -1, -1, -1, -1, 1, -1, -1]


def test_padding_beyond_proposal_len_is_not_trusted_from_the_shard():
    s = Proposals(step_id=1, width=3, has_probs=False, seq_ids=[1], proposal_lens=[1], token_ids=[5, 99, 98])
    m = merge_proposals([1], 3, [s])
    assert m.token_ids == [5, -1, -1]


def test_other_workers_sequences_are_skipped_but_keep_their_rows():
    # Shard rows: seq 3 (another target worker's), then seq 2: row 1 of the tensor.
    m = merge_proposals([1, 2], 2, [shard(2, {3: [7, 8], 2: [5]})])
    assert m == MergedProposals([-1, -1, 5, -1], [0, 1], [-1, 1])


def test_errors():
    with pytest.raises(ValueError, match="width 3"):
        merge_proposals([1, 2], 2, [shard(3, {1: [1]})])
    with pytest.raises(ValueError, match="width 2"):
        merge_proposals([1, 2], 3, [shard(3, {1: [1]}), shard(2, {2: [1]})])


def test_random_shards_against_a_reference():
    rng = random.Random(7)
    for _ in range(200):
        k = rng.randrange(1, 6)
        n = rng.randrange(0, 12)
        seq_ids = rng.sample(range(1000), n)
        proposing = [s for s in seq_ids if rng.random() < 0.7]
        rng.shuffle(proposing)
        shards, cut = [], 0
        while cut < len(proposing):
            size = rng.randrange(1, 4)
            rows = {s: [rng.randrange(50_000) for _ in range(rng.randrange(0, k + 1))]
                    for s in proposing[cut:cut + size]}
            shards.append(shard(k, rows, has_probs=rng.random() < 0.6))
            cut += size
        # reference: concatenated probs rows, looked up by sequence
        expect_tokens = {s: [-1] * k for s in seq_ids}
        expect_rows = {s: -1 for s in seq_ids}
        offset = 0
        for sh in shards:
            for r, s in enumerate(sh.seq_ids):
                m = sh.proposal_lens[r]
                expect_tokens[s] = sh.token_ids[r * k:r * k + m] + [-1] * (k - m)
                if sh.has_probs and m:
                    expect_rows[s] = offset + r
            offset += len(sh.seq_ids) if sh.has_probs else 0
        got = merge_proposals(seq_ids, k, shards)
        assert got.token_ids == [t for s in seq_ids for t in expect_tokens[s]]
        assert got.proposal_lens == [sum(t >= 0 for t in expect_tokens[s]) for s in seq_ids]
        assert got.draft_rows == [expect_rows[s] for s in seq_ids]
