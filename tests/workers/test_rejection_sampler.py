"""The rejection sampler: exact greedy cases, deterministic sampling cases, a statistical
test that emitted tokens follow the target distribution, and a row-by-row comparison with
the textbook per-row loop (gpt-fast's ``speculative_decode``) fed the same uniforms."""

from __future__ import annotations

import pytest
import torch
from scipy import stats

from specray.workers.rejection_sampler import greedy_accept, random_verify
from specray.workers.sampling import sample_from_probs

# -- greedy --------------------------------------------------------------------------------


def _greedy(target, draft, lens):
    k = len(target[0]) - 1
    return greedy_accept([t for row in target for t in row], [t for row in draft for t in row], lens, k)


def test_greedy_all_accepted_emits_bonus():
    assert _greedy([[5, 6, 7, 8]], [[5, 6, 7]], [3]) == [[5, 6, 7, 8]]


def test_greedy_first_rejection_recovers_target_argmax():
    assert _greedy([[5, 6, 7, 8]], [[5, 9, 7]], [3]) == [[5, 6]]
    assert _greedy([[5, 6, 7, 8]], [[1, 6, 7]], [3]) == [[5]]


def test_greedy_no_proposals_emits_argmax():
    assert _greedy([[5, 6, 7, 8], [3, 3, 3, 3]], [[-1] * 3] * 2, [0, 0]) == [[5], [3]]
    # Nothing proposed at all: the proposal list may be empty.
    assert greedy_accept([5, 6, 7, 8, 3, 3, 3, 3], [], [0, 0], 3) == [[5], [3]]


def test_greedy_mixed_batch():
    target = [[1, 2, 3, 4],
              [1, 2, 3, 4],
              [1, 2, 3, 4],
              [1, 2, 3, 4],
              [9, 8, 7, 6]]
    draft = [[1, 2, 3],     # k=3 all accepted -> bonus 4
             [1, 2, -1],    # k=2 all accepted -> bonus target[:, 2] = 3
             [1, 5, 3],     # rejected at 1; the later match does not count
             [2, -1, -1],   # k=1 rejected at 0
             [-1, -1, -1]]  # k=0
    assert _greedy(target, draft, [3, 2, 3, 1, 0]) == [[1, 2, 3, 4], [1, 2, 3], [1, 2], [1], [9]]


def test_greedy_ignores_tokens_past_proposal_len():
    # A draft token past k_i that happens to equal the argmax must not be accepted.
    assert _greedy([[1, 2, 3, 4]], [[1, 2, 3]], [1]) == [[1, 2]]


def test_greedy_k0_batch():
    assert greedy_accept([4, 2], [], [0, 0], 0) == [[4], [2]]


def test_greedy_matches_random_verify_at_a_one_hot_target():
    """A second code path: the device rejection sampler, fed a one-hot target (the greedy
    limit) and one-hot drafts, must emit exactly what greedy acceptance emits."""
    g = torch.Generator().manual_seed(3)
    n, k, vocab = 300, 4, 5
    target = torch.randint(0, vocab, (n, k + 1), generator=g)
    lens = torch.randint(0, k + 1, (n,), generator=g)
    wrong = torch.randint(0, vocab, (n, k), generator=g)
    draft = torch.where(torch.rand(n, k, generator=g) < 0.7, target[:, :k], wrong)
    draft = torch.where(torch.arange(k) < lens.unsqueeze(-1), draft, torch.full_like(draft, -1))
    p = torch.nn.functional.one_hot(target, vocab).float()
    out, num = random_verify(p, draft, None, torch.zeros(n, dtype=torch.bool), lens,
                             torch.rand(n, k, generator=g), torch.rand(n, k + 1, generator=g))
    want = [row[:c] for row, c in zip(out.tolist(), num.tolist())]
    assert greedy_accept(target.flatten().tolist(), draft.flatten().tolist(), lens.tolist(), k) == want


# -- random: deterministic cases -----------------------------------------------------------

def _rand_dists(g, *shape, zeros=0.0):
    x = torch.rand(*shape, generator=g) + 0.05
    if zeros:
        x[torch.rand(*shape, generator=g) < zeros] = 0.0
        x[..., 0] += 0.1          # never an all-zero row
    return x / x.sum(-1, keepdim=True)


def test_random_q_equals_p_accepts_everything():
    g = torch.Generator().manual_seed(0)
    n, k, vocab = 500, 3, 11
    p = _rand_dists(g, n, k + 1, vocab)
    q = p[:, :k].clone()
    ids = sample_from_probs(q.reshape(-1, vocab), torch.rand(n * k, generator=g, dtype=torch.float64)).view(n, k)
    lens = torch.full((n,), k)
    accept_u = torch.rand(n, k, generator=g, dtype=torch.float64)
    accept_u[0] = 0.0
    accept_u[1] = 0.999999
    sample_u = torch.rand(n, k + 1, generator=g, dtype=torch.float64)
    out, emitted = random_verify(p, ids, q, torch.ones(n, dtype=torch.bool), lens, accept_u, sample_u)
    assert emitted.tolist() == [k + 1] * n
    assert torch.equal(out[:, :k], ids)
    # The bonus token is the target's own sample at position k with that position's uniform.
    assert torch.equal(out[:, k], sample_from_probs(p[:, k], sample_u[:, k]))


def test_random_zero_target_probability_is_always_rejected():
    g = torch.Generator().manual_seed(1)
    n, vocab = 20_000, 5
    p0 = torch.tensor([0.3, 0.0, 0.25, 0.25, 0.2])
    q0 = torch.tensor([0.1, 0.5, 0.3, 0.05, 0.05])
    p = torch.stack([p0, torch.full((vocab,), 0.2)]).expand(n, 2, vocab)
    q = q0.view(1, 1, vocab).expand(n, 1, vocab)
    ids = torch.full((n, 1), 1)                                  # the token the target never emits
    accept_u = torch.rand(n, 1, generator=g, dtype=torch.float64)
    accept_u[:10] = 0.0                                          # even u = 0 rejects
    sample_u = torch.rand(n, 2, generator=g, dtype=torch.float64)
    out, emitted = random_verify(p, ids, q, torch.ones(n, dtype=torch.bool), torch.ones(n, dtype=torch.long),
                                 accept_u, sample_u)
    assert emitted.tolist() == [1] * n
    assert (out[:, 1] == -1).all()
    recovered = out[:, 0]
    residual = (p0 - q0).clamp(min=0)                            # [0.2, 0, 0, 0.2, 0.15]
    assert bool((residual[recovered] > 0).all())
    counts = torch.bincount(recovered, minlength=vocab)
    keep = residual > 0
    assert _chi2(counts[keep], residual[keep]) > 1e-3


def test_random_one_hot_proposal_is_deterministic_proposal():
    """has_draft_probs False: q is one-hot at the proposal, whatever draft_probs holds:
    accept iff u < p(x); on rejection sample p with x removed."""
    g = torch.Generator().manual_seed(2)
    n, k, vocab = 400, 2, 7
    p = _rand_dists(g, n, k + 1, vocab, zeros=0.3)
    ids = torch.randint(0, vocab, (n, k), generator=g)
    lens = torch.randint(0, k + 1, (n,), generator=g)
    ids[torch.arange(k) >= lens.unsqueeze(-1)] = -1
    accept_u = torch.rand(n, k, generator=g, dtype=torch.float64)
    sample_u = torch.rand(n, k + 1, generator=g, dtype=torch.float64)
    garbage = _rand_dists(g, n, k, vocab)
    one_hot = torch.nn.functional.one_hot(ids.clamp(min=0), vocab).float()
    yes, no = torch.ones(n, dtype=torch.bool), torch.zeros(n, dtype=torch.bool)
    a = random_verify(p, ids, None, no, lens, accept_u, sample_u)
    b = random_verify(p, ids, garbage, no, lens, accept_u, sample_u)
    c = random_verify(p, ids, one_hot, yes, lens, accept_u, sample_u)
    for other in (b, c):
        assert torch.equal(a[0], other[0]) and torch.equal(a[1], other[1])
    # Mixed: half the rows carry real draft probs, the others are one-hot.
    mixed = torch.arange(n) % 2 == 0
    d = random_verify(p, ids, garbage, mixed, lens, accept_u, sample_u)
    e = random_verify(p, ids, garbage, yes, lens, accept_u, sample_u)
    assert torch.equal(d[0][~mixed], a[0][~mixed]) and torch.equal(d[0][mixed], e[0][mixed])
    # The semantics, row by row.
    out, emitted = a
    for r in range(n):
        acc = 0
        while acc < lens[r] and accept_u[r, acc] < p[r, acc, ids[r, acc]]:
            acc += 1
        assert emitted[r] == acc + 1
        assert out[r, :acc].tolist() == ids[r, :acc].tolist()
        tok = int(out[r, acc])
        assert p[r, acc, tok] > 0
        if acc < lens[r]:
            assert tok != ids[r, acc]          # the rejected token is removed from the residual


def test_random_seeded_determinism_and_batch_independence():
    g = torch.Generator().manual_seed(3)
    n, k, vocab = 300, 4, 9
    p = _rand_dists(g, n, k + 1, vocab, zeros=0.2)
    q = _rand_dists(g, n, k, vocab, zeros=0.2)
    ids = sample_from_probs(q.reshape(-1, vocab), torch.rand(n * k, generator=g, dtype=torch.float64)).view(n, k)
    lens = torch.randint(0, k + 1, (n,), generator=g)
    ids[torch.arange(k) >= lens.unsqueeze(-1)] = -1
    has = torch.rand(n, generator=g) < 0.7
    au = torch.rand(n, k, generator=g, dtype=torch.float64)
    su = torch.rand(n, k + 1, generator=g, dtype=torch.float64)
    out1, n1 = random_verify(p, ids, q, has, lens, au, su)
    out2, n2 = random_verify(p.clone(), ids.clone(), q.clone(), has.clone(), lens.clone(), au.clone(), su.clone())
    assert torch.equal(out1, out2) and torch.equal(n1, n2)
    perm = torch.randperm(n, generator=g)
    out3, n3 = random_verify(p[perm], ids[perm], q[perm], has[perm], lens[perm], au[perm], su[perm])
    assert torch.equal(out3, out1[perm]) and torch.equal(n3, n1[perm])
    # Output shape contract: -1 past the emitted tokens, 1 <= emitted <= k_i + 1.
    assert bool(((n1 >= 1) & (n1 <= lens + 1)).all())
    past = torch.arange(k + 1) >= n1.unsqueeze(-1)
    assert bool((out1[past] == -1).all()) and bool((out1[~past] >= 0).all())


def test_random_k0_samples_the_target():
    g = torch.Generator().manual_seed(6)
    n, vocab = 50, 8
    p = _rand_dists(g, n, 1, vocab, zeros=0.4)
    su = torch.rand(n, 1, generator=g, dtype=torch.float64)
    out, emitted = random_verify(p, torch.zeros(n, 0, dtype=torch.long), None, torch.zeros(n, dtype=torch.bool),
                                 torch.zeros(n, dtype=torch.long), torch.zeros(n, 0, dtype=torch.float64), su)
    assert emitted.tolist() == [1] * n
    assert torch.equal(out[:, 0], sample_from_probs(p[:, 0], su[:, 0]))


# -- random: statistics --------------------------------------------------------------------

def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    counts = counts.double()
    expected = probs.double() / probs.double().sum() * counts.sum()
    return float(stats.chisquare(counts.numpy(), expected.numpy()).pvalue)


@pytest.mark.parametrize("deterministic_draft", [False, True])
def test_random_emitted_tokens_follow_target_distribution(deterministic_draft):
    g = torch.Generator().manual_seed(4)
    n, k, vocab = 20_000, 2, 5
    p_dists = torch.tensor([[0.40, 0.30, 0.15, 0.10, 0.05],
                            [0.05, 0.20, 0.50, 0.05, 0.20],
                            [0.20, 0.20, 0.20, 0.20, 0.20]])
    q_dists = torch.tensor([[0.10, 0.10, 0.20, 0.30, 0.30],
                            [0.30, 0.30, 0.10, 0.20, 0.10]])
    p = p_dists.expand(n, k + 1, vocab)
    q = q_dists.expand(n, k, vocab)
    ids = torch.stack([sample_from_probs(q[:, j], torch.rand(n, generator=g, dtype=torch.float64))
                       for j in range(k)], dim=1)                                   # x_j ~ q_j
    accept_u = torch.rand(n, k, generator=g, dtype=torch.float64)
    sample_u = torch.rand(n, k + 1, generator=g, dtype=torch.float64)
    lens = torch.full((n,), k)
    if deterministic_draft:     # an n-gram style proposal: q is one-hot at x
        out, emitted = random_verify(p, ids, None, torch.zeros(n, dtype=torch.bool), lens, accept_u, sample_u)
    else:
        out, emitted = random_verify(p, ids, q, torch.ones(n, dtype=torch.bool), lens, accept_u, sample_u)
    first = torch.bincount(out[:, 0], minlength=vocab)
    assert _chi2(first, p_dists[0]) > 1e-3
    # Power: the draft's own distribution (what an unchecked draft would emit) is rejected.
    assert _chi2(first, q_dists[0]) < 1e-6
    # The second token, among rows that emitted one, follows p_1 (x_1 is independent of x_0 here).
    second = torch.bincount(out[emitted >= 2, 1], minlength=vocab)
    assert _chi2(second, p_dists[1]) > 1e-3
    if not deterministic_draft:
        # Acceptance rate of the first proposal is sum(min(p, q)).
        rate = float((emitted >= 2).double().mean())
        assert abs(rate - float(torch.minimum(p_dists[0], q_dists[0]).sum())) < 0.02


# -- random vs the textbook loop -----------------------------------------------------------

def reference_verify(p, ids, q, has_q, lens, accept_u, sample_u):
    """gpt-fast's rejection step written per row; categorical draws go through
    sample_from_probs with the same uniform so results compare exactly."""
    n, k1, vocab = p.shape
    out = torch.full((n, k1), -1, dtype=torch.long)
    emitted = torch.zeros(n, dtype=torch.long)
    for r in range(n):
        tokens = []
        for j in range(int(lens[r])):
            x = int(ids[r, j])
            qj = q[r, j] if has_q[r] else torch.nn.functional.one_hot(torch.tensor(x), vocab).to(p.dtype)
            if float(accept_u[r, j]) < float(p[r, j, x]) / float(qj[x]):
                tokens.append(x)
                continue
            residual = (p[r, j] - qj).clamp(min=0)
            tokens.append(int(sample_from_probs(residual.unsqueeze(0), sample_u[r, j:j + 1])[0]))
            break
        else:
            j = int(lens[r])
            tokens.append(int(sample_from_probs(p[r, j].unsqueeze(0), sample_u[r, j:j + 1])[0]))
        out[r, :len(tokens)] = torch.tensor(tokens)
        emitted[r] = len(tokens)
    return out, emitted


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_random_matches_reference_loop_row_by_row(dtype):
    g = torch.Generator().manual_seed(5)
    n, k, vocab = 1200, 3, 6
    p = _rand_dists(g, n, k + 1, vocab, zeros=0.25).to(dtype)
    q = _rand_dists(g, n, k, vocab, zeros=0.25).to(dtype)
    # Some rows where the draft is nearly right, so long accepted runs occur too.
    close = torch.rand(n, generator=g) < 0.3
    q[close] = 0.9 * p[close, :k] + 0.1 * q[close]
    ids = sample_from_probs(q.reshape(-1, vocab), torch.rand(n * k, generator=g, dtype=torch.float64)).view(n, k)
    has_q = torch.rand(n, generator=g) < 0.8
    lens = torch.randint(0, k + 1, (n,), generator=g)
    ids[torch.arange(k) >= lens.unsqueeze(-1)] = -1
    accept_u = torch.rand(n, k, generator=g, dtype=torch.float64)
    sample_u = torch.rand(n, k + 1, generator=g, dtype=torch.float64)
    out, emitted = random_verify(p, ids, q, has_q, lens, accept_u, sample_u)
    ref_out, ref_emitted = reference_verify(p, ids, q, has_q, lens, accept_u, sample_u)
    assert torch.equal(emitted, ref_emitted)
    assert torch.equal(out, ref_out)
    # The comparison covered every outcome: no proposals, rejections at each position, full acceptance.
    assert set(emitted.tolist()) == {1, 2, 3, 4}
    assert bool(((emitted == lens + 1) & (lens == k)).any()) and bool((emitted <= lens).any())
