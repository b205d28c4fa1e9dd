"""TargetWorker.verify against the plain transformers model: with greedy sampling the
emitted tokens are exactly the model's greedy continuation, however many proposals were
right; the sampled path is checked where its outcome is certain (q == p, top-k 1)."""

from __future__ import annotations

import pytest
import torch
from specray_testing import worker_configs

from specray.workers.sampling import STREAM_TARGET, keyed_uniform, logits_to_probs, sample_from_probs
from specray.workers.target_worker import TargetWorker, packed_verify_batch

VOCAB = 96
K = 3


@pytest.fixture(scope="module")
def target_path(tiny_model):
    return tiny_model("qwen2", seed=31)


@pytest.fixture(scope="module")
def worker(target_path):
    return TargetWorker(*worker_configs(target_path))


def _rand(g, n):
    return torch.randint(0, VOCAB, (n,), generator=g).tolist()


def target_plan(plan_builder, seqs, proposals, *, computed=None, step_id=1, draft_rows=None, **knobs):
    """seqs: {seq_id: tokens}; proposals: {seq_id: list of k_i tokens}. Reserves len + k_i slots."""
    sids = list(seqs)
    computed = computed or {s: 0 for s in sids}
    k_i = [len(proposals[s]) for s in sids]
    flat = [t for s in sids for t in proposals[s] + [-1] * (K - len(proposals[s]))]
    toks = [t for s in sids for t in seqs[s][computed[s]:]]
    return plan_builder(sids, [computed[s] for s in sids], [len(seqs[s]) - computed[s] for s in sids], toks,
                        [len(seqs[s]) + k for s, k in zip(sids, k_i)], width=K, proposal_lens=k_i,
                        proposal_token_ids=flat, draft_rows=draft_rows if draft_rows is not None else [-1] * len(sids),
                        step_id=step_id, **knobs)


def emitted_by_seq(result):
    out, pos = {}, 0
    for sid, n in zip(result.seq_ids, result.num_emitted):
        out[sid] = result.token_ids[pos:pos + n]
        pos += n
    return out


def wrong(t):
    return (t + 1) % VOCAB


def test_greedy_verify_matches_hf_greedy(worker, target_path, hf_model, hf_ref, plan_builder):
    ref = hf_model(target_path)
    g = torch.Generator().manual_seed(3)
    seqs = {0: _rand(g, 5), 1: _rand(g, 8), 2: _rand(g, 11), 3: _rand(g, 3), 4: _rand(g, 6), 5: _rand(g, 4)}
    G = {s: hf_ref.greedy(ref, t, K + 1) for s, t in seqs.items()}
    proposals = {
        0: G[0][:3],                                  # k_i = k, all right -> 4 tokens
        1: G[1][:2],                                  # k_i < k, all right -> 3 tokens
        2: [G[2][0], wrong(G[2][1]), G[2][2]],        # wrong at j = 1 (a later match is ignored)
        3: [wrong(G[3][0]), G[3][1], G[3][2]],        # wrong at j = 0
        4: [],                                        # no proposals -> 1 token
        5: [G[5][0], G[5][1], wrong(G[5][2])],        # wrong at the last position
    }
    expect_n = {0: 4, 1: 3, 2: 2, 3: 1, 4: 1, 5: 3}
    result = worker.verify(target_plan(plan_builder, seqs, proposals))
    result.validate()
    assert result.seq_ids == list(seqs) and result.step_id == 1
    assert result.proposed == [len(proposals[s]) for s in seqs]
    assert result.num_emitted == [expect_n[s] for s in seqs]
    got = emitted_by_seq(result)
    for s in seqs:
        assert got[s] == G[s][:expect_n[s]], s
    worker.runner.kv.blocks.check_integrity()

    # Next step: the driver appends the emitted tokens; the target has L + accepted cached
    # (rejected proposals' slots are stale) and feeds the last emitted token.
    new = {s: seqs[s] + got[s] for s in seqs}
    computed = {s: len(seqs[s]) + expect_n[s] - 1 for s in seqs}
    G2 = {s: hf_ref.greedy(ref, t, K + 1) for s, t in new.items()}
    proposals2 = {0: G2[0][:1], 1: [wrong(G2[1][0])], 2: G2[2][:3], 3: G2[3][:2] + [wrong(G2[3][2])],
                  4: G2[4][:3], 5: []}
    expect_n2 = {0: 2, 1: 1, 2: 4, 3: 3, 4: 4, 5: 1}
    result = worker.verify(target_plan(plan_builder, new, proposals2, computed=computed, step_id=2))
    result.validate()
    assert result.num_emitted == [expect_n2[s] for s in new]
    got = emitted_by_seq(result)
    for s in new:
        assert got[s] == G2[s][:expect_n2[s]], s
    worker.runner.kv.blocks.check_integrity()


def test_no_proposals_at_all(worker, target_path, hf_model, hf_ref, plan_builder):
    """A plan without proposal tokens (speculation off for the whole step)."""
    ref = hf_model(target_path)
    g = torch.Generator().manual_seed(4)
    seqs = {20: _rand(g, 7), 21: _rand(g, 2)}
    plan = plan_builder(list(seqs), [0, 0], [7, 2], seqs[20] + seqs[21], [7, 2], width=K)
    result = worker.verify(plan)
    assert result.proposed == [0, 0] and result.num_emitted == [1, 1]
    assert result.token_ids == [hf_ref.greedy(ref, seqs[20], 1)[0], hf_ref.greedy(ref, seqs[21], 1)[0]]


def test_sampled_verify_certain_outcomes(worker, target_path, hf_model, hf_ref, plan_builder):
    """Sampled rows whose outcome does not depend on chance:
    - q == p (the draft is the target): every proposal accepted, bonus = the keyed sample of p_k;
    - top-k 1 with a one-hot proposal of another token: rejected, recovered = argmax;
    - top-k 1 with the argmax proposed: accepted, so the row follows greedy."""
    ref = hf_model(target_path)
    g = torch.Generator().manual_seed(5)
    seqs = {30: _rand(g, 6), 31: _rand(g, 5), 32: _rand(g, 9), 33: _rand(g, 4)}
    temp, seed = 0.9, 1234
    # Seq 30: proposals drawn from its own target distribution, q = p at each position.
    toks = list(seqs[30])
    p_ref = []
    for j in range(K + 1):
        p_ref.append(logits_to_probs(hf_ref.logits(ref, toks)[-1:], torch.tensor([temp]), [0], [1.0])[0])
        if j < K:
            toks.append(int(torch.multinomial(p_ref[-1], 1, generator=g)))
    props30 = toks[len(seqs[30]):]
    q30 = torch.stack(p_ref[:K]).unsqueeze(0)                               # [1, k, V]
    G31 = hf_ref.greedy(ref, seqs[31], 1)
    G32 = hf_ref.greedy(ref, seqs[32], K + 1)
    proposals = {30: props30, 31: [wrong(G31[0]), 4], 32: G32[:K], 33: [7, 8]}
    # Two draft shards: seq 33's shard sent other probabilities (one-hot at seq 30's
    # proposals: used for seq 30 they would reject), seq 30 is row 1 of the concatenation.
    garbage = torch.nn.functional.one_hot(torch.tensor([props30]), VOCAB).float()
    plan = target_plan(plan_builder, seqs, proposals, draft_rows=[1, -1, -1, 0],
                       temperature=[temp, 0.7, 1.5, 0.0], top_k=[0, 1, 1, 0], top_p=[1.0, 1.0, 1.0, 1.0],
                       seeds=[seed, 1, 2, 3])
    result = worker.verify(plan, garbage, q30)
    result.validate()
    got = emitted_by_seq(result)
    L = len(seqs[30])
    u = keyed_uniform(torch.tensor([seed]), torch.tensor([L + K]), STREAM_TARGET)
    assert got[30] == props30 + [int(sample_from_probs(p_ref[K].unsqueeze(0), u)[0])]
    assert got[31] == G31
    assert got[32] == G32
    G33 = hf_ref.greedy(ref, seqs[33], 3)                                   # greedy row: ignores the shard's q
    n33 = 1 + (G33[0] == 7) + (G33[0] == 7 and G33[1] == 8)
    assert got[33] == G33[:n33]

    # The check has power: pointing seq 30 at the other shard's row changes its outcome.
    plan.seq_ids = [s + 10 for s in plan.seq_ids]
    plan.draft_rows = [0, -1, -1, 1]
    swapped = emitted_by_seq(worker.verify(plan, garbage, q30))
    assert swapped[40] != got[30]


def test_k0_step_and_frees(worker, target_path, hf_model, hf_ref, plan_builder):
    """Speculation off (k = 0): a sampled row with top-k 1 and a greedy row both emit the argmax;
    an empty plan only frees."""
    ref = hf_model(target_path)
    g = torch.Generator().manual_seed(6)
    a, b = _rand(g, 5), _rand(g, 9)
    plan = plan_builder([60, 61], [0, 0], [5, 9], a + b, [5, 9], width=0, temperature=[0.8, 0.0], top_k=[1, 0],
                        seeds=[3, 4])
    result = worker.verify(plan)
    assert result.num_emitted == [1, 1]
    assert result.token_ids == [hf_ref.greedy(ref, a, 1)[0], hf_ref.greedy(ref, b, 1)[0]]
    used = worker.runner.kv.blocks.num_used_blocks
    result = worker.verify(plan_builder([], [], [], [], [], width=0, free_seq_ids=[60, 61]))
    assert result.seq_ids == [] and worker.runner.kv.blocks.num_used_blocks == used - 2 - 3
    worker.runner.kv.blocks.check_integrity()


def _packed_reference(token_ids, num_new, props, plens, k):
    """The layout written out one sequence at a time."""
    tokens, fed, rows, start, pos = [], [], [], 0, 0
    for i, m in enumerate(num_new):
        tokens += token_ids[start:start + m] + props[i * k:i * k + plens[i]]
        start += m
        fed.append(m + plens[i])
        last = pos + m - 1
        rows += [last + min(j, plens[i]) for j in range(k + 1)]
        pos += fed[-1]
    return tokens, fed, rows


@pytest.mark.parametrize("k", [0, 1, 4])
def test_packed_verify_batch_matches_a_per_sequence_reference(k):
    g = torch.Generator().manual_seed(k)
    for _ in range(200):
        n = int(torch.randint(1, 9, (1,), generator=g))
        num_new = torch.randint(1, 6, (n,), generator=g).tolist()
        plens = torch.randint(0, k + 1, (n,), generator=g).tolist()
        token_ids = _rand(g, sum(num_new))
        props = [t if j < plens[i] else -1 for i in range(n) for j, t in enumerate(_rand(g, k))]
        got = packed_verify_batch(token_ids, num_new, props if k else [], plens, k)
        tokens, fed, rows = _packed_reference(token_ids, num_new, props, plens, k)
        assert (got.tokens, got.fed, got.score_rows) == (tokens, fed, rows)
        # Each scored row goes through the head once: m + 1 rows per sequence, in order.
        assert got.logit_rows == sorted(set(rows)) and len(got.logit_rows) == sum(plens) + n


def _logprob_rows(result):
    """Per sequence: its emitted tokens with (logprob, top ids, top logprobs), or None."""
    out, pos, lp, top = {}, 0, 0, 0
    for i, (sid, e) in enumerate(zip(result.seq_ids, result.num_emitted)):
        n = result.num_top[i] if result.num_top else -1
        if n < 0:
            out[sid] = None
        else:
            out[sid] = [(result.token_ids[pos + j], result.logprobs[lp + j],
                         result.top_ids[top + j * n:top + (j + 1) * n],
                         result.top_logprobs[top + j * n:top + (j + 1) * n]) for j in range(e)]
            lp += e
            top += e * n
        pos += e
    return out


def test_logprobs_are_the_targets_raw_log_softmax(worker, target_path, hf_model, hf_ref, plan_builder):
    """Every emitted token of the sequences that asked (accepted proposals, corrections,
    bonus tokens; greedy and sampled rows) carries transformers' own log-softmax at the
    position that emitted it, untouched by temperature and top-k, with its top-n; the
    others carry nothing and emit what they would without a neighbour asking."""
    ref = hf_model(target_path)
    g = torch.Generator().manual_seed(8)
    seqs = {70: _rand(g, 6), 71: _rand(g, 4), 72: _rand(g, 9), 73: _rand(g, 5), 74: _rand(g, 7)}
    G = {s: hf_ref.greedy(ref, t, K + 1) for s, t in seqs.items()}
    proposals = {70: G[70][:3], 71: [G[71][0], wrong(G[71][1])], 72: [], 73: G[73][:3], 74: [wrong(G[74][0])]}
    asked = [0, 3, 20, 5, -1]
    knobs = dict(temperature=[0.0, 0.0, 0.0, 0.7, 0.9], top_k=[0, 0, 0, 5, 3], seeds=[1, 2, 3, 4, 5])
    result = worker.verify(target_plan(plan_builder, seqs, proposals, logprobs=asked, **knobs))
    result.validate()
    assert result.num_top == asked
    rows = _logprob_rows(result)
    assert rows[74] is None
    for s, n in zip(seqs, asked[:4]):
        assert len(rows[s]) == len(emitted_by_seq(result)[s])
        for j, (tok, lp, top_ids, top_lp) in enumerate(rows[s]):
            history = seqs[s] + [t for t, *_ in rows[s][:j]]
            want = torch.log_softmax(hf_ref.logits(ref, history)[-1], dim=-1)
            assert abs(lp - want[tok].item()) < 1e-4, (s, j)
            values, ids = want.topk(n)
            assert torch.allclose(torch.tensor(top_lp), values, atol=1e-4)
            assert top_ids == ids.tolist()
    assert len(rows[70]) == 4 and len(rows[71]) == 2        # bonus token; a correction
    # Asking changes no token: the same step again, nobody asking.
    again = worker.verify(target_plan(plan_builder, {s + 10: t for s, t in seqs.items()},
                                      {s + 10: p for s, p in proposals.items()}, **knobs))
    assert again.token_ids == result.token_ids and again.num_top == [] and again.logprobs == []
