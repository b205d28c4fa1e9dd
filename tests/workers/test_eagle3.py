"""An EAGLE-3 head proposing in the target worker, against independent readings.

The head is trained here, in plain torch (``eagle3_reference``), on the target's own greedy
continuations and saved with safetensors in the published layout; specray loads it from
that directory. Greedy output must equal transformers' greedy output of the target, and
every step's drafts must be those the plain-torch reading of the checkpoint predicts from
the sequence so far (so the accepted counts are too)."""

from __future__ import annotations

import itertools
import json
import shutil

import pytest
import torch
from eagle3_reference import RefHead, head_config, random_weights, ref_drafts, save_head, target_aux, train_head
from specray_testing import make_plan, worker_configs

from specray.scheduler.messages import IN_TARGET_ROW
from specray.workers.eagle3_loader import fit_target, load_eagle3
from specray.workers.llama_model import AuxCapture
from specray.workers.target_worker import TargetWorker

VOCAB, HIDDEN, DRAFT_VOCAB = 96, 32, 64
LAYER_IDS = (0, 1, 2)           # as the config writes them: layer outputs
AUX_INPUTS = (1, 2, 3)          # the same states as inputs of layers
K = 3


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # Tiny matrices: more threads than one only contend (the suite shares two cores).
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def target_path(tiny_model):
    return tiny_model("llama", seed=7, num_hidden_layers=4)


@pytest.fixture(scope="module")
def target(target_path, hf_model):
    return hf_model(target_path)


@torch.no_grad()
def greedy(target, prompts: torch.Tensor, n: int) -> torch.Tensor:
    """transformers' own greedy generate: [B, P] -> [B, P + n]."""
    return target.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=n, do_sample=False,
                           pad_token_id=0, eos_token_id=None)


@pytest.fixture(scope="module")
def head(tmp_path_factory, target):
    """A head trained on the target's greedy continuations of a few prompts (next-but-one
    token from the target's hidden states, as EAGLE-3's first step trains), its draft
    vocabulary the most frequent tokens there (as EAGLE's scandata picks it). A random
    tiny target generalises nothing, so the head learns these continuations by heart:
    drafting them again, it is right often. Returns its directory and the corpus."""
    torch.manual_seed(0)
    corpus = greedy(target, torch.randint(0, VOCAB, (4, 4)), 32)                     # [4, 36]
    cfg = head_config(layer_ids=LAYER_IDS)
    weights, d2t = train_head(target, corpus, cfg, AUX_INPUTS)
    path = save_head(tmp_path_factory.mktemp("eagle3") / "head", cfg, weights, d2t)
    return path, corpus


@pytest.fixture(scope="module")
def head_path(head):
    return head[0]


@pytest.fixture(scope="module")
def reading(head_path, target):
    """The plain-torch reading of the saved checkpoint: (RefHead, target ids of draft ids)."""
    from safetensors.torch import load_file

    tensors = load_file(f"{head_path}/model.safetensors")
    cfg = json.loads(open(f"{head_path}/config.json").read())
    ids = torch.arange(cfg["draft_vocab_size"]) + tensors["d2t"]
    return RefHead(cfg, tensors, target.model.embed_tokens.weight.detach()), ids


def recording(worker) -> list:
    """The worker's head, its proposals recorded as it makes them inside ``verify``:
    [(rows, tokens per row, probabilities)] per call."""
    calls = []
    propose = worker.head.propose

    def record(plan, rows):
        tokens, probs = propose(plan, rows)
        calls.append((rows, tokens, probs))
        return tokens, probs

    worker.head.propose = record
    return calls


@pytest.fixture(scope="module")
def worker(target_path, head_path):
    w = TargetWorker(*worker_configs(target_path, num_kv_blocks=96), head=head_path)
    w.made = recording(w)
    return w


def head_plan(seq_ids, computed, new, tokens, slots, lens, width, **kw):
    """A target plan whose sequences ask the head in the target for their proposals
    (``IN_TARGET_ROW``), as the driver's ``InTargetProposer`` marks them."""
    n = len(seq_ids)
    return make_plan(seq_ids, computed, new, tokens, slots, width=width, proposal_lens=lens,
                     proposal_token_ids=[-1] * (n * width), draft_rows=[IN_TARGET_ROW] * n, **kw)


def run_steps(worker, prompts, max_new, k=K, recompute_at=None):
    """A scheduler in miniature: every step the head proposes for each sequence (within what
    ``max_new`` leaves) and the target verifies. ``recompute_at=(step, sid)``: that step
    drops the sequence's cache and feeds it whole again (a preemption's recompute).
    Returns ({sid: emitted tokens}, [(sid, tokens before the step, proposals, accepted)])."""
    seqs = {i: list(p) for i, p in enumerate(prompts)}
    computed = dict.fromkeys(seqs, 0)
    emitted = {i: [] for i in seqs}
    log = []
    for step in itertools.count(1):
        active = [s for s in seqs if len(emitted[s]) < max_new]
        if not active:
            return emitted, log
        free = []
        if recompute_at and recompute_at[0] == step and recompute_at[1] in active:
            free = [recompute_at[1]]
            computed[recompute_at[1]] = 0
        lens = [min(k, max_new - len(emitted[s]) - 1) for s in active]
        plan = head_plan(active, [computed[s] for s in active], [len(seqs[s]) - computed[s] for s in active],
                         [t for s in active for t in seqs[s][computed[s]:]],
                         [len(seqs[s]) + n for s, n in zip(active, lens)], lens, k, free_seq_ids=free, step_id=step)
        result = worker.verify(plan)
        rows, made, _ = worker.made[-1]
        assert rows == list(range(len(active))) and result.proposed == [len(m) for m in made]
        pos = 0
        for i, (s, n) in enumerate(zip(result.seq_ids, result.num_emitted)):
            tokens = result.token_ids[pos:pos + n]
            pos += n
            log.append((s, list(seqs[s]), made[i], n - 1))
            computed[s] = len(seqs[s]) + n - 1
            seqs[s] += tokens
            emitted[s] += tokens
        worker.runner.kv.blocks.check_integrity()


def common_prefix(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def test_greedy_output_and_drafts_match_independent_readings(worker, target, reading, head):
    ref, ids = reading
    corpus = head[1]
    # Prefixes of the training continuations, and one prompt the head never saw.
    prompts = [corpus[0, :6].tolist(), corpus[1, :9].tolist(), corpus[2, :5].tolist(), [7, 70, 17, 71]]
    max_new = 24
    got, log = run_steps(worker, prompts, max_new, recompute_at=(4, 1))
    for s, p in enumerate(prompts):
        want = greedy(target, torch.tensor([p]), max_new)[0, len(p):].tolist()
        assert got[s] == want, s
    full = {s: prompts[s] + got[s] for s in got}
    with torch.no_grad():
        # Causal: the target's states over the whole output hold those of every prefix.
        aux = {s: target_aux(target, torch.tensor([full[s]]), AUX_INPUTS)[0] for s in full}
    drafted = accepted = 0
    for s, before, proposals, n_accepted in log:
        if not proposals:
            continue
        assert proposals == ref_drafts(ref, aux[s], before, len(proposals), ids), (s, len(before))
        assert n_accepted == common_prefix(proposals, full[s][len(before):])
        drafted += len(proposals)
        accepted += n_accepted
    # Every step but each sequence's first (and the recompute) drafted; on the continuations
    # it learnt, the head is right often.
    assert drafted >= 30
    assert accepted >= 20, (accepted, drafted)
    assert not worker.head._observed.keys() - set(got)


def test_first_step_and_recompute_propose_nothing(worker, target_path):
    got, log = run_steps(worker, [[5, 6, 7, 8]], 8, recompute_at=(3, 0))
    by_step = [proposals for _, _, proposals, _ in log]
    assert by_step[0] == [] and by_step[2] == []
    assert by_step[1] and by_step[3]


def test_aux_capture_is_the_residual_stream_entering_each_layer(worker, target):
    r = worker.runner
    tokens = [3, 14, 15, 92, 65, 35]
    aux = AuxCapture((1, 3, 2, 0))
    r.kv.blocks.allocate_slots(999, len(tokens))
    r.forward([999], [0], [len(tokens)], r.to_device(tokens), torch.tensor([len(tokens) - 1]), aux=aux)
    r.kv.blocks.free(999)
    hs = target(input_ids=torch.tensor([tokens]), output_hidden_states=True).hidden_states
    want = torch.cat([hs[i][0] for i in (1, 3, 2, 0)], dim=-1)
    torch.testing.assert_close(aux.concat(), want, atol=1e-5, rtol=1e-5)


def test_aux_layers_follow_the_config_or_the_default(target):
    class Config:
        hidden_size, num_hidden_layers, vocab_size = HIDDEN, 32, VOCAB

    def fitted(tmp, **over):
        cfg = head_config(**over)
        return fit_target(load_eagle3(save_head(tmp, cfg, random_weights(cfg, HIDDEN, 0), torch.zeros(DRAFT_VOCAB))),
                          Config).aux_inputs

    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as d:
        assert fitted(Path(d) / "a", layer_ids=None) == (2, 16, 29)             # EAGLE's and vLLM's default
        assert fitted(Path(d) / "b", layer_ids=(1, 15, 28)) == (2, 16, 29)      # ids count layer outputs
        assert fitted(Path(d) / "c", layer_ids=None, eagle_aux_hidden_state_layer_ids=[0, 3, 5]) == (1, 4, 6)


BAD = {
    "architectures": lambda c, w, d: c.update(architectures=["LlamaForCausalLM"]),
    "num_hidden_layers": lambda c, w, d: c.update(num_hidden_layers=2),
    "target_hidden_size": lambda c, w, d: (c.update(target_hidden_size=48), w.update(
        {"fc.weight": torch.zeros(HIDDEN, 3 * 48)})),
    "eagle_aux_hidden_state_layer_ids": lambda c, w, d: c["eagle_config"].update(
        eagle_aux_hidden_state_layer_ids=[0, 1, 3]),
    "fc.weight takes": lambda c, w, d: (c["eagle_config"].update(eagle_aux_hidden_state_layer_ids=[0, 1]),),
    "vocab_size": lambda c, w, d: c.update(vocab_size=VOCAB + 1),
    "d2t maps draft ids outside": lambda c, w, d: d.__setitem__(DRAFT_VOCAB - 1, VOCAB),
    "d2t maps two draft ids": lambda c, w, d: d.__setitem__(1, d[0] - 1),
    "lacks lm_head.weight": lambda c, w, d: w.pop("lm_head.weight"),
    "draft_vocab_size": lambda c, w, d: w.update({"lm_head.weight": torch.zeros(DRAFT_VOCAB + 1, HIDDEN)}),
    "embed_tokens.weight": lambda c, w, d: w.update({"embed_tokens.weight": torch.zeros(VOCAB, HIDDEN + 1)}),
}


@pytest.mark.parametrize("field", list(BAD))
def test_bad_heads_are_refused_naming_the_field(field, head_path, target, tmp_path):
    from safetensors.torch import load_file

    cfg = json.loads(open(f"{head_path}/config.json").read())
    weights = load_file(f"{head_path}/model.safetensors")
    d2t = weights.pop("d2t").clone()
    BAD[field](cfg, weights, d2t)
    bad = save_head(tmp_path / "bad", cfg, weights, d2t)
    with pytest.raises(ValueError, match=field):
        fit_target(load_eagle3(bad), target.config)


def test_target_worker_refuses_a_head_that_does_not_fit(head_path, target_path, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(head_path, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [0, 1, 7]
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="eagle_aux_hidden_state_layer_ids"):
        TargetWorker(*worker_configs(target_path), head=str(bad))


def test_sampled_output_has_the_targets_joint_distribution(target_path, head_path, head, target):
    """Two tokens sampled through the head's own q (temperature 1, top-k 3): their joint
    frequencies against the target's exact joint distribution (chi-square)."""
    from scipy.stats import chisquare

    n, temp, top_k = 1500, 1.0, 3
    worker = TargetWorker(*worker_configs(target_path, num_kv_blocks=n * 4, max_num_seqs=n), head=head_path)
    made = recording(worker)
    prompt = head[1][0, :6].tolist()
    sids = list(range(n))
    # Step 1 (prefill): the first token greedy, so the joint that follows is one distribution.
    first = worker.verify(make_plan(sids, [0] * n, [len(prompt)] * n, prompt * n, [len(prompt)] * n, step_id=1))
    x1 = first.token_ids[0]
    assert set(first.token_ids) == {x1}
    seqs = {s: prompt + [x1] for s in sids}
    computed = dict.fromkeys(sids, len(prompt))
    out = {s: [] for s in sids}
    proposed = accepted = 0
    for step in (2, 3):
        active = [s for s in sids if len(out[s]) < 2]
        if not active:
            break
        m = len(active)
        plan = head_plan(active, [computed[s] for s in active], [len(seqs[s]) - computed[s] for s in active],
                         [t for s in active for t in seqs[s][computed[s]:]], [len(seqs[s]) + 2 for s in active],
                         [2] * m, 2, step_id=step, temperature=[temp] * m, top_k=[top_k] * m,
                         seeds=[1000 + s for s in active])
        result = worker.verify(plan)
        assert made[-1][2].shape == (m, 2, VOCAB)
        proposed += sum(result.proposed)
        pos = 0
        for s, k in zip(result.seq_ids, result.num_emitted):
            tokens = result.token_ids[pos:pos + k]
            pos += k
            accepted += k - 1
            computed[s] = len(seqs[s]) + k - 1
            seqs[s] += tokens
            out[s] += tokens
    # The target's exact joint of (x2, x3) under temperature 1 and top-k 3, from its logits.
    def dist(tokens):
        logits = target(input_ids=torch.tensor([tokens])).logits[0, -1].double() / temp
        kth = logits.topk(top_k).values[-1]
        return torch.softmax(logits.masked_fill(logits < kth, float("-inf")), -1)
    with torch.no_grad():
        p2 = dist(prompt + [x1])
        cells = {(a, b): float(p2[a] * dist(prompt + [x1, a])[b])
                 for a in p2.nonzero().flatten().tolist() for b in range(VOCAB)}
    cells = {c: p for c, p in cells.items() if p > 0}
    counts = {c: 0 for c in cells}
    for s in sids:
        counts[tuple(out[s][:2])] += 1          # a pair outside the support would raise here
    f_obs = [counts[c] for c in cells]
    f_exp = [n * cells[c] for c in cells]
    assert chisquare(f_obs, f_exp).pvalue > 1e-3
    # The head's q was verified, and often kept.
    assert proposed >= 2 * n and accepted > 0.2 * proposed, (accepted, proposed)
