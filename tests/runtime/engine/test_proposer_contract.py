"""The one proposer contract (``specray.scheduler.proposers.proposer``) through the real
``Engine``: a proposer of the test's own, the draft model's ranks and the draft+suffix
merge are driven by the same path; and ``metrics()["acceptance_by_position"]`` against
per-position counts made from the tokens the target verified (fake targets, and the real
proposers over the real target worker)."""

from __future__ import annotations

import pytest
from engine_harness import MIXED, Harness, V, add_requests, assert_matches_reference, build, default_wrong, true_next

from specray.runtime.config import RuntimeConfig
from specray.runtime.driver.core import DriverCore
from specray.runtime.engine.core import Engine
from specray.runtime.transport.worker_call import WorkerLost
from specray.scheduler.messages import Proposals, StepPlan
from specray.scheduler.proposers.proposer import Proposer
from specray.scheduler.sampling_params import SamplingParams
from specray.scheduler.sequence import Sequence
from specray.scheduler.step import StepOutcome


class OwnProposer(Proposer):
    """A two-rank proposer the engine has never heard of: it reads each sequence's tokens
    from the ``Sequence`` (no KV of its own), proposes the true next tokens, wrong where
    ``default_wrong`` says and one short for sequence ids divisible by 4; rank 1's worker
    dies at its ``die_at``-th call and answers again three steps later. It records every
    call the engine makes."""

    num_ranks = 2

    def __init__(self, harness: Harness, die_at: int | None = None) -> None:
        self.h = harness
        self.die_at = die_at
        self.calls = {0: 0, 1: 0}
        self.down_since: int | None = None
        self.log: list[tuple] = []
        self.finished_ids: list[int] = []

    def submit(self, rank: int, plan: StepPlan, seqs: list[Sequence]) -> tuple[int, Proposals | None]:
        assert [s.seq_id for s in seqs] == plan.seq_ids
        assert all(s.draft_rank == rank for s in seqs)
        self.calls[rank] += 1
        self.log.append(("submit", plan.step_id, rank))
        if rank == 1 and self.calls[1] == self.die_at:
            self.down_since = self.h.tick
            return rank, None
        lens, toks = [], []
        for s, n in zip(seqs, plan.proposal_lens):
            n = n - 1 if s.seq_id % 4 == 0 and n else n
            props: list[int] = []
            for _ in range(n):
                t = true_next(s.tokens + props)
                props.append((t + 1) % V if default_wrong(s.seq_id, s.num_tokens + len(props)) else t)
            self.h._proposed[s.seq_id] = props         # what the fake target checks it verifies
            lens.append(n)
            toks += props + [-1] * (plan.width - n)
        return rank, Proposals(step_id=plan.step_id, width=plan.width, seq_ids=list(plan.seq_ids),
                               proposal_lens=lens, token_ids=toks)

    def wait(self, rank: int, handle):
        got_rank, props = handle
        assert got_rank == rank
        self.log.append(("wait", rank))
        if props is None:
            raise WorkerLost("rank 1 died")
        return props, None

    def observe(self, outcome: StepOutcome) -> None:
        self.log.append(("observe", outcome.step.step_id))
        for v in outcome.verdicts:
            seq = next(s for s in outcome.step.seqs if s.seq_id == v.seq_id)
            assert seq.num_tokens == seq.step_len       # before the scheduler applies the verdict

    def finished(self, seq: Sequence) -> None:
        self.finished_ids.append(seq.seq_id)

    def alive(self, rank: int) -> bool:
        return rank == 0 or self.down_since is None or self.h.tick >= self.down_since + 3


def count_positions(plan, result, proposed: list[int], accepted: list[int]) -> None:
    """Adds one verify step to the per-position counts: position j was proposed where the
    plan carried a j-th proposal, and accepted where the first j proposals equal the first
    j tokens emitted."""
    pos = 0
    for i in range(len(result.seq_ids)):
        n = plan.proposal_lens[i] if plan.proposal_token_ids else 0
        props = plan.proposal_token_ids[i * plan.width:i * plan.width + n]
        emitted = result.token_ids[pos:pos + result.num_emitted[i]]
        pos += result.num_emitted[i]
        for j in range(n):
            proposed[j] += 1
            accepted[j] += props[:j + 1] == emitted[:j + 1]


class PositionCounts:
    """Per draft position, what the fake target verified and kept, counted from the
    tokens (``count_positions``)."""

    def __init__(self, eng: Harness, k: int) -> None:
        self.proposed, self.accepted = [0] * k, [0] * k
        verify = eng.verify

        def counted(r, plan, probs):
            result = verify(r, plan, probs)
            count_positions(plan, result, self.proposed, self.accepted)
            return result
        eng.verify = counted

    def rates(self) -> list[float]:
        return [a / p if p else 0.0 for a, p in zip(self.accepted, self.proposed)]


def ticking(eng: Harness) -> None:
    step = eng.step

    def stepped() -> bool:
        eng.tick += 1
        return step()
    eng.step = stepped


def test_a_proposer_of_its_own_drives_the_real_engine():
    """Two ranks, one lost for a few steps: outputs stay plain greedy decoding's; every
    submit is waited for on its own rank; the verdicts come once a step, before the
    scheduler applies them; each finished request is told once; and acceptance by
    position is what the target counted."""
    eng = build(k=4, draft_ranks=2, draft_blocks=None, max_model_len=64)
    own = OwnProposer(eng, die_at=5)
    eng.engine = Engine(eng.sched, eng.engine.verifiers, own)
    counts = PositionCounts(eng, 4)
    ticking(eng)
    ref = add_requests(eng, MIXED)
    eng.run()
    assert_matches_reference(eng, ref)
    assert sorted(own.finished_ids) == sorted(ref)
    m = eng.sched.stats.as_dict()
    assert m["acceptance_by_position"] == pytest.approx(counts.rates())
    assert len(m["acceptance_by_position"]) == 4 and 0 < min(counts.accepted)
    assert sum(counts.proposed) == m["num_draft_tokens"]
    assert eng.sched.stats.num_draft_worker_failures == 1 and own.calls[1] > own.die_at    # lost, then back
    # Per step: its submits, then a wait per submit on the same rank, then one observe.
    steps = [e for e in own.log if e[0] == "observe"]
    assert len(steps) == eng.counts.steps
    submitted = [e for e in own.log if e[0] == "submit"]
    assert len([e for e in own.log if e[0] == "wait"]) == len(submitted)


@pytest.mark.parametrize("proposer", ["draft", "draft+suffix"])
def test_acceptance_by_position_counts_every_proposer(proposer):
    """The draft model's ranks and the merge of the draft with a suffix proposer beside it:
    the same per-position figures as the target's own count."""
    wrong = (lambda sid, pos: (sid + 2 * pos) % 5 == 0) if proposer == "draft+suffix" else None
    eng = build(k=3, draft_ranks=2, target_ranks=2, max_model_len=64, suffix_wrong=wrong)
    counts = PositionCounts(eng, 3)
    ref = add_requests(eng, MIXED)
    eng.run()
    assert_matches_reference(eng, ref)
    rates = eng.sched.stats.as_dict()["acceptance_by_position"]
    assert rates == pytest.approx(counts.rates()) and len(rates) == 3
    assert all(0 < r < 1 for r in rates)


@pytest.mark.parametrize("proposer", ["draft", "ngram", "suffix", "draft+suffix"])
def test_acceptance_by_position_of_the_real_proposers(llama_pair, proposer):
    """The real proposers and the target worker in process: the figures equal what the
    target's verify calls show, counted from their tokens (greedy: a proposal is kept
    exactly where it equals the token the target emits at its position)."""
    t, d = llama_pair
    k = 3
    cfg = RuntimeConfig(target=t, draft=d if "draft" in proposer else None, proposer=proposer,
                        num_speculative_tokens=k, block_size=4, device="cpu", dtype="float32", layout="colocated")
    drv = DriverCore(cfg, export_metrics=False)
    proposed, accepted = [0] * k, [0] * k
    try:
        call = drv.engine.verifiers[0]
        verify = call.fn

        def counted(plan, probs):
            result = verify(plan, probs)
            count_positions(plan, result, proposed, accepted)
            return result
        call.fn = counted
        prompts = [[5, 6, 7, 5, 6, 7], [8, 9, 10, 11], [1, 2, 1, 2, 1]] * 2     # repeats: suffix proposes
        drv.wait(drv.submit(prompts, [SamplingParams(max_tokens=24, temperature=0.0)] * 6).request_ids, timeout=120)
        m = drv.metrics(workers=False)
    finally:
        drv.shutdown()
    assert sum(proposed) == m["num_draft_tokens"] > 0
    assert m["acceptance_by_position"] == pytest.approx([a / p if p else 0.0 for a, p in zip(accepted, proposed)])
