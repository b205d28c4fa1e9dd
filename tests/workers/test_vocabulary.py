"""Drafts whose vocabulary is padded differently from the target's: the tokenizer check
(ids both score must name the same tokens), and the draft worker proposing only ids the
target scores, with its probabilities over the target's vocabulary."""

from __future__ import annotations

import time

import pytest
import torch
from specray_testing import make_pair, word_tokenizer, worker_configs

from specray.workers.draft_worker import DraftWorker
from specray.workers.sampling import logits_to_probs
from specray.workers.vocabulary import check_pair, id_to_token, vocabulary_mismatch

V, K = 97, 3


def test_one_tokenizer_padded_two_ways_agrees():
    # Ids only one of them maps (the longer one's tail) are not compared.
    assert vocabulary_mismatch(word_tokenizer(60), word_tokenizer(90), 90) is None
    assert vocabulary_mismatch(word_tokenizer(90), word_tokenizer(90), 60) is None


def test_a_different_tokenizer_is_named_with_what_differs():
    why = vocabulary_mismatch(word_tokenizer(40), word_tokenizer(40, prefix="v"), 40)
    assert why.startswith("37 of the 40 shared token ids differ")
    assert "id 3 is 'w3' to the target and 'v3' to the draft" in why
    with pytest.raises(ValueError) as e:
        check_pair("/m/target", "/m/draft", 97, 90, word_tokenizer(40), word_tokenizer(40, prefix="v"))
    msg = str(e.value)
    assert "draft '/m/draft' (vocab_size 90, tokenizer TokenizersBackend of 40 tokens)" in msg
    assert "target '/m/target' (vocab_size 97, tokenizer TokenizersBackend of 40 tokens)" in msg
    assert "do not share a tokenizer: 37 of the 90 shared token ids differ" in msg
    # Without both tokenizers there is nothing to compare: the pair is taken on trust.
    check_pair("t", "d", 97, 90, word_tokenizer(40), None)
    check_pair("t", "d", 97, 90, None, word_tokenizer(40, prefix="v"))


def test_the_check_is_linear_in_a_real_sized_vocabulary():
    big = word_tokenizer(152_000)
    assert len(id_to_token(big, 151_936)) == 151_936
    t0 = time.perf_counter()
    assert vocabulary_mismatch(big, big, 151_936) is None
    # Two passes over 150k entries and one comparison: about 0.1 s here; quadratic would be hours.
    assert time.perf_counter() - t0 < 5.0


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """The same target with drafts of its vocabulary, of fewer rows (80) and of more (110);
    the rows they share are the same weights."""
    root = tmp_path_factory.mktemp("vocab")
    out = {}
    for dv in (V, 80, 110):
        out[dv] = make_pair(root / str(dv), vocab=V, draft_vocab=dv)
    assert len({t for t, _ in out.values()}) == 3
    return out


def draft_worker(pairs, dv):
    target, draft = pairs[dv]
    return DraftWorker(*worker_configs(target, draft))


def test_a_smaller_draft_gives_probabilities_over_the_target_vocabulary(pairs, plan_builder, hf_model, hf_ref):
    w = draft_worker(pairs, 80)
    assert (w.runner.vocab_size, w.target_vocab) == (80, V)
    ref = hf_model(pairs[80][1])
    # Sequence 1 holds ids the draft has no row for (a target may emit its padding ids):
    # the draft reads them as its token 0.
    seqs = {0: [5, 9, 14, 5, 9], 1: [85, 7, 96, 7, 85]}
    toks = [t for s in seqs.values() for t in s]
    props, probs = w.propose(plan_builder(list(seqs), [0, 0], [5, 5], toks, [7, 7], width=K, proposal_lens=[K, K],
                                          temperature=[0.0, 0.0]))
    got = [props.token_ids[i * K:(i + 1) * K] for i in range(2)]
    assert got[0] == hf_ref.greedy(ref, seqs[0], K)
    assert got[1] == hf_ref.greedy(ref, [t if t < 80 else 0 for t in seqs[1]], K)
    assert probs is None
    # Sampling: [n, k, V_target], the draft's own distribution, zero past its vocabulary.
    props, probs = w.propose(plan_builder([2], [0], [5], seqs[0], [7], width=K, proposal_lens=[K],
                                          temperature=[1.0], seeds=[3]))
    assert probs.shape == (1, K, V)
    assert bool((probs[0, :, 80:] == 0).all())
    first = logits_to_probs(hf_ref.logits(ref, seqs[0])[-1:], torch.tensor([1.0]))[0]
    torch.testing.assert_close(probs[0, 0, :80], first, atol=1e-5, rtol=0)
    # Ids past the target's vocabulary are still refused.
    with pytest.raises(ValueError, match="token_ids"):
        w.propose(plan_builder([3], [0], [2], [4, V], [4], width=K, proposal_lens=[K]))


def test_a_larger_draft_never_proposes_past_the_target_vocabulary(pairs, plan_builder, hf_model, hf_ref):
    """The 110-row draft's extra head rows are twice some shared ones: unmasked, its argmax
    would often be one of them. Cut to the target's 97 ids it is the same-vocabulary draft."""
    big, same = draft_worker(pairs, 110), draft_worker(pairs, V)
    g = torch.Generator().manual_seed(4)
    seqs = [torch.randint(0, V, (6,), generator=g).tolist() for _ in range(8)]
    n = len(seqs)
    ref = hf_model(pairs[110][1])
    assert any(int(hf_ref.logits(ref, s)[-1].argmax()) >= V for s in seqs)   # unmasked, it would

    def plan(first_id, **knobs):
        return plan_builder(list(range(first_id, first_id + n)), [0] * n, [6] * n, [t for s in seqs for t in s],
                            [8] * n, width=K, proposal_lens=[K] * n, **knobs)

    a, _ = big.propose(plan(0))
    b, _ = same.propose(plan(0))
    assert a.token_ids == b.token_ids and max(a.token_ids) < V
    sampled = dict(temperature=[0.9] * n, seeds=list(range(n)))
    (a, pa), (b, pb) = big.propose(plan(100, **sampled)), same.propose(plan(100, **sampled))
    assert pa.shape == pb.shape == (n, K, V)
    assert a.token_ids == b.token_ids
    torch.testing.assert_close(pa, pb, atol=1e-6, rtol=0)
