"""Bucketed (CUDA graph) steps, run uncaptured on CPU: the padded forward a graph replays.

References: transformers' ``generate`` (greedy through padded decode and verify steps),
the eager runner (logits of the same steps within float32 tolerance), and the cache
itself (padding rows write the scratch block and nothing else)."""

from __future__ import annotations

import pytest
import torch
from specray_testing import hf_greedy, model_runner

from specray.runtime.config import RuntimeConfig
from specray.runtime.driver.core import DriverCore
from specray.scheduler.sampling_params import SamplingParams
from specray.workers import step_graphs
from specray.workers.graph_capture import Uncaptured
from specray.workers.step_graphs import StepGraphs, batch_buckets, table_widths

VOCAB = 96
BLOCK = 4
TOL = 1e-4


def runner_for(path, graphs: bool, max_num_seqs=8, blocks=64, query_lens=(1, 3)):
    r = model_runner(path, block_size=BLOCK, num_kv_blocks=blocks, max_num_seqs=max_num_seqs, executor="native")
    assert r.graphs is None                 # no CUDA here: the runner keeps its eager path
    if graphs:
        r.graphs = StepGraphs(r.native, r.kv, max_num_seqs, r.max_model_len, query_lens, Uncaptured())
        r.graphs.capture_all()
    return r


def step(r, plan_builder, state, feeds):
    sids = list(feeds)
    comp = [state.get(s, 0) for s in sids]
    new = [len(feeds[s]) for s in sids]
    toks = [t for s in sids for t in feeds[s]]
    r.kv.apply(plan_builder(sids, comp, new, toks, [c + n for c, n in zip(comp, new)]))
    logits = r.forward(sids, comp, new, r.to_device(toks), r.to_device(list(range(len(toks)))))
    for s, n in zip(sids, new):
        state[s] = state.get(s, 0) + n
    return dict(zip(sids, logits.split(new)))


def test_batch_buckets():
    assert batch_buckets(1) == [1]
    assert batch_buckets(5) == [1, 2, 4, 5]
    assert batch_buckets(8) == [1, 2, 4, 8]
    assert batch_buckets(20) == [1, 2, 4, 8, 16, 20]
    assert batch_buckets(256)[-3:] == [240, 248, 256]


def test_table_widths():
    assert table_widths(1) == [1]
    assert table_widths(5) == [1, 2, 4, 5]
    assert table_widths(8) == [1, 2, 4, 8]


def test_which_steps_are_bucketed(tiny_model):
    g = runner_for(tiny_model("llama", seed=40), graphs=True, max_num_seqs=20, query_lens=(1, 5)).graphs
    assert g.shape([5, 9, 3], [1, 1, 1]) == (4, 1, 4)          # 3 -> bucket 4; 10 tokens -> 3 blocks -> 4
    assert g.shape([5], [5]) == (1, 5, 4)                      # a verify window of 5
    assert g.shape([17] * 9, [1] * 9) == (16, 1, 8)
    assert g.shape([5, 9], [1, 2]) is None                     # ragged
    assert g.shape([0, 9], [4, 4]) is None                     # a prefill
    assert g.shape([5] * 21, [1] * 21) is None                 # past the largest bucket
    assert g.shape([5], [step_graphs.MAX_QUERY + 1]) is None
    assert g.shape([5], [2]) is None                           # a width no bucket was captured for
    assert len(g.buckets) == g.captured == 6 * 2 * len(table_widths(32))


def test_buckets_stop_at_max_batch(tiny_model):
    g = runner_for(tiny_model("llama", seed=40), graphs=True, max_num_seqs=100, query_lens=(1,)).graphs
    assert g.batches[-1] == step_graphs.MAX_BATCH
    assert g.shape([5] * step_graphs.MAX_BATCH, [1] * step_graphs.MAX_BATCH) is not None
    assert g.shape([5] * (step_graphs.MAX_BATCH + 1), [1] * (step_graphs.MAX_BATCH + 1)) is None


@pytest.mark.parametrize("kind,over", [("llama", {}), ("mistral", {"sliding_window": 5}),
                                       ("qwen3", {"head_dim": 16})])
def test_padded_steps_equal_generate_and_the_eager_path(kind, over, tiny_model, plan_builder):
    path = tiny_model(kind, seed=41, **over)
    graphed, eager = runner_for(path, graphs=True), runner_for(path, graphs=False)
    g = torch.Generator().manual_seed(7)
    prompts = {s: torch.randint(0, VOCAB, (n,), generator=g).tolist() for s, n in zip(range(3), (6, 2, 11))}
    n_new = 14
    want = dict(zip(prompts, hf_greedy(path, list(prompts.values()), n_new)))
    sg, se = {}, {}
    got = {s: [] for s in prompts}
    for r, state in ((graphed, sg), (eager, se)):
        out = step(r, plan_builder, state, prompts)                 # packed prefill: eager in both
        if r is graphed:
            for s in prompts:
                got[s].append(int(out[s][-1].argmax()))
    i = 0
    while min(len(v) for v in got.values()) < n_new:
        i += 1
        live = [s for s in prompts if len(got[s]) < n_new]
        if i == 4:
            live = live[:1]                                          # a batch of one (bucket 1)
        if i % 2 == 0 and all(len(got[s]) + 3 <= n_new for s in live):
            # Verify-shaped: the last token and the reference's next two, every sequence.
            feeds = {s: got[s][-1:] + want[s][len(got[s]):len(got[s]) + 2] for s in live}
        else:
            feeds = {s: got[s][-1:] for s in live}
        x, y = step(graphed, plan_builder, sg, feeds), step(eager, plan_builder, se, feeds)
        for s in feeds:
            assert (x[s] - y[s]).abs().max().item() < TOL
            produced = x[s].argmax(-1).tolist()
            got[s] += produced if len(feeds[s]) > 1 else produced[-1:]
    assert got == want
    assert graphed.graphs.replays >= i


def test_padding_rows_write_only_the_scratch_block(tiny_model, plan_builder):
    r = runner_for(tiny_model("llama", seed=42), graphs=True)
    state = {}
    step(r, plan_builder, state, {0: [1, 2, 3, 4, 5], 1: [6, 7], 2: [8, 9, 10]})
    before = [t.clone() for layer in r.kv.layers for t in layer]
    step(r, plan_builder, state, {0: [11], 1: [12], 2: [13]})       # 3 sequences, bucket 4: one padding row
    assert r.graphs.replays == 1
    bs = BLOCK
    written = {r.kv.blocks.block_table(s)[(state[s] - 1) // bs] * bs + (state[s] - 1) % bs for s in state}
    scratch = set(range(r.kv.scratch_block * bs, (r.kv.scratch_block + 1) * bs))
    for old, new in zip(before, (t for layer in r.kv.layers for t in layer)):
        changed = set((old != new).any(-1).any(-1).nonzero().flatten().tolist())
        assert written <= changed <= written | scratch and changed & scratch


def test_the_runtime_serves_through_bucketed_steps(llama_pair, monkeypatch):
    """Draft passes and verify windows through the padded path (every runner of the
    runtime takes it, as on CUDA): greedy output equals generate."""
    monkeypatch.setattr(step_graphs, "available", lambda device: True)
    replays = []
    shape = StepGraphs.shape

    def spy(self, *a):
        got = shape(self, *a)
        if got is not None:
            replays.append(got)
        return got

    monkeypatch.setattr(StepGraphs, "shape", spy)
    t, d = llama_pair
    drv = DriverCore(RuntimeConfig(layout="colocated",
                                   target=t, draft=d, num_speculative_tokens=3, block_size=4, device="cpu",
                                   dtype="float32"))
    prompts = [[5, 6, 7], [8, 9, 10, 11], [3] * 9]
    try:
        out = drv.wait(drv.submit(prompts, [SamplingParams(max_tokens=16, temperature=0.0)] * 3).request_ids,
                       timeout=120)
        accepted = drv.metrics()["num_accepted_tokens"]
    finally:
        drv.shutdown()
    assert [o.token_ids for o in out] == hf_greedy(t, prompts, 16)
    assert accepted > 0
    assert {q for _, q, _ in replays} >= {1, 4}        # draft passes and full verify windows


def test_cuda_graphs_option_is_checked_and_reaches_the_workers():
    from specray.workers.config import ModelConfig

    with pytest.raises(ValueError, match="cuda_graphs must be true or false, got 'yes'"):
        ModelConfig(target="t", cuda_graphs="yes")
    # Workers are built from the model section itself (draft and target alike).
    assert RuntimeConfig(target="t", proposer="none", cuda_graphs=False).model.cuda_graphs is False
