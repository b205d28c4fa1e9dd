"""A proposer inside the target worker's process (the seam an EAGLE head plugs into):
the driver asks through ``InTargetProposer``, the target worker makes the proposals in its
verify call (``specray.workers.in_target_head``). A fake head that proposes the
reference continuation, wrong at some positions, with made-up probabilities: greedy
output equals transformers' own, and seeded samples equal the same proposals and
probabilities sent the ordinary way, from a proposer in the driver (a second code path
into the same rejection sampler)."""

from __future__ import annotations

import pytest
import torch
from specray_testing import hf_greedy

from specray.runtime.config import RuntimeConfig
from specray.runtime.driver.core import DriverCore
from specray.scheduler.messages import Proposals, StepPlan, StepResult
from specray.scheduler.proposers.in_target import InTargetProposer
from specray.scheduler.proposers.proposer import HostProposer
from specray.scheduler.sampling_params import SamplingParams
from specray.workers.in_target_head import InTargetHead

K, MAX_NEW = 3, 16
PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12], [1, 2], [40, 41, 42, 43]]


class Reference:
    """What both proposers propose: the reference continuation of a history, wrong where
    ``(seq id + position) % 3 == 0`` (a function of the history past the references), with
    probabilities 0.1 on the proposal and the rest spread evenly (far from one-hot: the
    sampler's decisions depend on them)."""

    def __init__(self, full: list[list[int]], vocab: int) -> None:
        self.full, self.vocab = full, vocab

    def tokens(self, sid: int, history: list[int], n: int) -> list[int]:
        for f in self.full:
            if f[:len(history)] == history:
                nxt = f[len(history):len(history) + n]
                return [(t + 1) % self.vocab if (sid + len(history) + j) % 3 == 0 else t
                        for j, t in enumerate(nxt)]
        # A sampled history leaves the greedy references: a function of it, then.
        return [(31 * history[-1] + 7 * (len(history) + j)) % self.vocab for j in range(n)]

    def probs(self, rows: list[list[int]], width: int) -> torch.Tensor:
        q = torch.full((len(rows), width, self.vocab), 0.9 / self.vocab)     # [rows, width, V]
        for a, props in enumerate(rows):
            for j, t in enumerate(props):
                q[a, j, t] += 0.1
        return q


class FakeHead(InTargetHead):
    """Keeps each sequence's tokens from what ``verified`` tells it, as a head keeps the
    target's hidden states, and proposes nothing for a sequence it holds nothing for."""

    def __init__(self, ref: Reference, sampling: bool) -> None:
        self.ref, self.sampling = ref, sampling
        self.held: dict[int, list[int]] = {}
        self.num_proposed = self.num_verified = 0

    def propose(self, plan: StepPlan, rows: list[int]):
        out, pos, starts = [], 0, []
        for n in plan.num_new:
            starts.append(pos)
            pos += n
        for i in rows:
            sid = plan.seq_ids[i]
            held = self.held.get(sid)
            fed = plan.token_ids[starts[i]:starts[i] + plan.num_new[i]]
            if held is None:
                out.append([])
                continue
            # The plan feeds what the worker has not computed, ending with the token the
            # last verify emitted: exactly the tail of what the head was told.
            assert held[:plan.num_computed[i]] + fed == held
            out.append(self.ref.tokens(sid, held, plan.proposal_lens[i]))
        self.num_proposed += sum(map(len, out))
        return out, self.ref.probs(out, plan.width) if self.sampling else None

    def verified(self, plan: StepPlan, result: StepResult) -> None:
        for sid in plan.free_seq_ids:
            self.held.pop(sid, None)
        pos, out = 0, 0
        for i, sid in enumerate(plan.seq_ids):
            held = self.held.get(sid, [])[:plan.num_computed[i]]
            held += plan.token_ids[pos:pos + plan.num_new[i]]
            held += result.token_ids[out:out + result.num_emitted[i]]
            pos += plan.num_new[i]
            out += result.num_emitted[i]
            self.held[sid] = held
        self.num_verified += 1


class DriverTwin(HostProposer):
    """The same proposals and probabilities from a proposer in the driver."""

    def __init__(self, ref: Reference, sampling: bool) -> None:
        self.ref, self.sampling = ref, sampling
        self.verified: set[int] = set()

    def submit(self, rank, plan, seqs):
        rows = [self.ref.tokens(s.seq_id, list(s.tokens), n) if s.seq_id in self.verified else []
                for s, n in zip(seqs, plan.proposal_lens)]
        props = Proposals(step_id=plan.step_id, width=plan.width, has_probs=self.sampling,
                          seq_ids=list(plan.seq_ids), proposal_lens=[len(r) for r in rows],
                          token_ids=[t for r in rows for t in r + [-1] * (plan.width - len(r))])
        return props, self.ref.probs(rows, plan.width) if self.sampling else None

    def propose_plan(self, plan, seqs):
        raise AssertionError("submit answers with probabilities")

    def observe(self, outcome):
        self.verified |= {v.seq_id for v in outcome.verdicts}


@pytest.fixture(scope="module")
def reference(llama_pair):
    t, _ = llama_pair
    outs = hf_greedy(t, PROMPTS, MAX_NEW)
    return outs, Reference([p + o for p, o in zip(PROMPTS, outs)], 97)


def serve(llama_pair, proposer, head, params) -> tuple[list[list[int]], dict]:
    t, _ = llama_pair
    cfg = RuntimeConfig(target=t, proposer="ngram", num_speculative_tokens=K, block_size=4, device="cpu",
                        dtype="float32", layout="colocated")
    drv = DriverCore(cfg, export_metrics=False)
    try:
        drv.engine.proposer = proposer
        drv.pool.local_workers[0].head = head
        outs = drv.wait(drv.submit(PROMPTS, params).request_ids, timeout=120)
        return [o.token_ids for o in outs], drv.metrics(workers=False)
    finally:
        drv.shutdown()


def test_greedy_output_with_the_targets_own_proposer_equals_transformers(llama_pair, reference):
    expected, ref = reference
    head = FakeHead(ref, sampling=False)
    got, m = serve(llama_pair, InTargetProposer(), head, [SamplingParams(max_tokens=MAX_NEW, temperature=0.0)] * 4)
    assert got == expected
    assert m["num_draft_tokens"] == head.num_proposed > 0 and 0 < m["acceptance_rate"] < 1
    assert head.num_verified == m["num_steps"]
    assert len(m["acceptance_by_position"]) == K


def test_sampled_output_equals_the_same_proposals_sent_from_the_driver(llama_pair, reference):
    """Seeded samples: the head's proposals and probabilities decide exactly as the same
    sent from the driver; treated as one-hot (no probabilities) they decide otherwise."""
    _, ref = reference
    params = [SamplingParams(max_tokens=MAX_NEW, temperature=1.0, seed=i) for i in range(4)]
    head = FakeHead(ref, sampling=True)
    in_target, m = serve(llama_pair, InTargetProposer(), head, params)
    from_driver, m2 = serve(llama_pair, DriverTwin(ref, sampling=True), None, params)
    one_hot, _ = serve(llama_pair, DriverTwin(ref, sampling=False), None, params)
    assert in_target == from_driver != one_hot
    assert m["num_draft_tokens"] == m2["num_draft_tokens"] == head.num_proposed > 0
    assert m["num_accepted_tokens"] == m2["num_accepted_tokens"]
