"""DraftWorker.propose against the plain transformers model: greedy proposals are the
model's greedy continuation (also after catch-up and rollback), sampled proposals come
with the distributions they were drawn from, and seeds make them reproducible."""

from __future__ import annotations

import pytest
import torch
from specray_testing import worker_configs

from specray.workers.draft_worker import DraftWorker
from specray.workers.sampling import STREAM_DRAFT, keyed_uniform, logits_to_probs, sample_from_probs

VOCAB = 96
K = 3


@pytest.fixture(scope="module")
def draft_path(tiny_model):
    return tiny_model("llama", seed=21)


@pytest.fixture(scope="module")
def worker(draft_path):
    # The draft as its own target: nothing else bounds its window or vocabulary.
    return DraftWorker(*worker_configs(draft_path, draft_path))


def _rand(g, n):
    return torch.randint(0, VOCAB, (n,), generator=g).tolist()


def draft_plan(plan_builder, seqs, k_i, *, computed=None, step_id=1, free=(), **knobs):
    """seqs: {seq_id: full token list}; the draft feeds tokens[num_computed:] and reserves
    len + k_i - 1 slots (its k_i passes write all proposals but the last)."""
    sids = list(seqs)
    computed = computed or {s: 0 for s in sids}
    toks = [t for s in sids for t in seqs[s][computed[s]:]]
    return plan_builder(sids, [computed[s] for s in sids], [len(seqs[s]) - computed[s] for s in sids], toks,
                        [len(seqs[s]) + k - 1 for s, k in zip(sids, k_i)], width=K, proposal_lens=k_i,
                        free_seq_ids=free, step_id=step_id, **knobs)


def rows(props):
    return [props.token_ids[i * props.width:(i + 1) * props.width] for i in range(len(props.seq_ids))]


def test_greedy_proposals_match_hf_with_catch_up(worker, draft_path, hf_model, hf_ref, plan_builder):
    ref = hf_model(draft_path)
    g = torch.Generator().manual_seed(1)
    seqs = {0: _rand(g, 6), 1: _rand(g, 9), 2: _rand(g, 4), 3: _rand(g, 7), 4: _rand(g, 5)}
    k_i = [3, 3, 2, 1, 2]
    props, probs = worker.propose(draft_plan(plan_builder, seqs, k_i))
    props.validate()
    assert probs is None and not props.has_probs
    assert props.seq_ids == list(seqs) and props.proposal_lens == k_i and props.step_id == 1
    got = rows(props)
    for (sid, toks), ki, row in zip(seqs.items(), k_i, got):
        assert row[:ki] == hf_ref.greedy(ref, toks, ki), sid
        assert row[ki:] == [-1] * (K - ki), sid
    worker.runner.kv.blocks.check_integrity()

    # The target's verdicts, and what the driver then counts as cached in the draft
    # (draft_computed = L + min(accepted, k_i - 1)):
    L = {s: len(t) for s, t in seqs.items()}
    new = {
        0: seqs[0] + got[0][:3] + [5],            # all 3 accepted + bonus: draft is 2 behind
        1: seqs[1] + got[1][:1] + [(got[1][1] + 1) % VOCAB],   # 1 accepted, slot L+1 is stale
        2: seqs[2] + [(got[2][0] + 7) % VOCAB],   # none accepted, slot L is stale
        3: seqs[3] + got[3][:1] + [9],            # k_i = 1 accepted + bonus: 2 behind
    }
    computed = {0: L[0] + 2, 1: L[1] + 1, 2: L[2], 3: L[3]}
    assert [len(new[s]) - computed[s] for s in new] == [2, 1, 1, 2]
    k2 = [2, 3, 3, 1]
    props, _ = worker.propose(draft_plan(plan_builder, new, k2, computed=computed, step_id=2, free=[4]))
    assert not worker.runner.kv.blocks.has(4)
    for (sid, toks), ki, row in zip(new.items(), k2, rows(props)):
        assert row[:ki] == hf_ref.greedy(ref, toks, ki), sid
        assert row[ki:] == [-1] * (K - ki), sid
    worker.runner.kv.blocks.check_integrity()


def test_sampled_proposals_carry_their_distributions(worker, draft_path, hf_model, hf_ref, plan_builder):
    ref = hf_model(draft_path)
    g = torch.Generator().manual_seed(2)
    seqs = {10: _rand(g, 5), 11: _rand(g, 8), 12: _rand(g, 6), 13: _rand(g, 3)}
    k_i = [3, 2, 3, 1]
    knobs = dict(temperature=[0.8, 1.3, 0.0, 1.0], top_k=[0, 5, 0, 3], top_p=[0.9, 1.0, 1.0, 0.8],
                 seeds=[11, 22, 33, 2**40 + 7])
    props, probs = worker.propose(draft_plan(plan_builder, seqs, k_i, **knobs))
    assert props.has_probs
    assert probs.shape == (4, K, VOCAB) and probs.dtype == torch.float32
    for i, ((_, toks), ki, row) in enumerate(zip(seqs.items(), k_i, rows(props))):
        assert row[ki:] == [-1] * (K - ki)
        assert bool((probs[i, ki:] == 0).all())
        if knobs["temperature"][i] == 0:
            assert row[:ki] == hf_ref.greedy(ref, toks, ki)       # a greedy row in a sampled batch
            continue
        for p in range(ki):
            q = probs[i, p]
            assert abs(q.sum().item() - 1) < 1e-5
            assert q[row[p]] > 0
            logits = hf_ref.logits(ref, toks + row[:p])[-1:]
            expect = logits_to_probs(logits, torch.tensor([knobs["temperature"][i]]), [knobs["top_k"][i]],
                                     [knobs["top_p"][i]])[0]
            torch.testing.assert_close(q, expect, atol=1e-5, rtol=0)
            # Drawn with the counter-based uniform of (seed, position, draft stream).
            u = keyed_uniform(torch.tensor([knobs["seeds"][i]]), torch.tensor([len(toks) + p]), STREAM_DRAFT)
            assert row[p] == int(sample_from_probs(expect.unsqueeze(0), u)[0])
        if knobs["top_k"][i]:
            assert int((probs[i, :ki] > 0).sum(-1).max()) <= knobs["top_k"][i]

    # Same seeds, same prompts, other sequence ids, another batch order and company:
    # identical proposals and probabilities.
    order = [12, 10, 13, 11]
    remap = {s: s + 100 for s in order}
    seqs2 = {remap[s]: seqs[s] for s in order}
    seqs2[200] = _rand(g, 4)
    pick = [list(seqs).index(s) for s in order]
    knobs2 = {name: [v[j] for j in pick] + [v[0]] for name, v in knobs.items()}
    props2, probs2 = worker.propose(draft_plan(plan_builder, seqs2, [k_i[j] for j in pick] + [2], **knobs2))
    r1, r2 = rows(props), rows(props2)
    for pos, j in enumerate(pick):
        assert r2[pos] == r1[j]
        torch.testing.assert_close(probs2[pos], probs[j], atol=1e-6, rtol=0)

    # Other seeds: other samples (the sampled rows cannot all coincide).
    knobs3 = dict(knobs, seeds=[s + 1000 for s in knobs["seeds"]])
    props3, _ = worker.propose(draft_plan(plan_builder, {s + 300: t for s, t in seqs.items()}, k_i, **knobs3))
    sampled = [i for i, t in enumerate(knobs["temperature"]) if t > 0]
    assert any(rows(props3)[i] != r1[i] for i in sampled)
    assert rows(props3)[2] == r1[2]                 # the greedy row does not depend on its seed
    worker.runner.kv.blocks.check_integrity()


def test_empty_plan_only_frees(worker, plan_builder):
    sids = [50, 51]
    worker.propose(plan_builder(sids, [0, 0], [3, 2], [1, 2, 3, 4, 5], [5, 4], width=K, proposal_lens=[3, 3]))
    used = worker.runner.kv.blocks.num_used_blocks
    props, probs = worker.propose(plan_builder([], [], [], [], [], width=K, free_seq_ids=sids))
    assert props.seq_ids == [] and probs is None
    assert worker.runner.kv.blocks.num_used_blocks == used - 3


@pytest.mark.parametrize("max_model_len, window_of, expected", [
    (2048, False, 128),     # the draft's own window
    (None, False, 128),     # no figure from the driver: the model's own
    (None, True, 48),       # the target's window bounds the draft's too
    (32, True, 32),         # and the driver's figure both
])
def test_window_is_the_smallest_of_the_figures_the_worker_reads(tiny_model, draft_path, plan_builder, max_model_len,
                                                               window_of, expected):
    """Workers start before the driver has read any config, so each worker bounds its own
    window: by the driver's max_model_len, its model's and its target's."""
    target = tiny_model("llama", seed=22, max_position_embeddings=48) if window_of else draft_path
    w = DraftWorker(*worker_configs(target, draft_path, max_model_len=max_model_len))
    assert w.runner.max_model_len == expected
    with pytest.raises(ValueError, match=f"max_model_len is {expected}"):
        w.propose(draft_plan(plan_builder, {1: list(range(expected + 1))}, [1]))
