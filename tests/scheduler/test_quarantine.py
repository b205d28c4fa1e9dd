"""A failed step keeps nothing and fails only the request that makes it fail
(``Scheduler.step_failed``, ``Quarantine``): over the real Scheduler and a worker pool that
applies plans as workers do, the other requests' outputs equal plain greedy decoding
(``engine_harness.reference``), the pools stay consistent, and faults that are no one
request's end."""

from __future__ import annotations

import math
from typing import Callable

import pytest
from engine_harness import make_seq, prompt_for, reference, true_next

from specray.scheduler.block_manager import BlockManager
from specray.scheduler.config import CacheConfig, SpeculationConfig
from specray.scheduler.messages import StepPlan
from specray.scheduler.quarantine import Quarantine
from specray.scheduler.scheduler import Scheduler
from specray.scheduler.step import ScheduledStep, StepOutcome, Verdict

BS = 4


class Pool:
    """A target worker's pool as ``workers/kv_cache.py`` resizes it: frees first, then each
    sequence's slots."""

    def __init__(self, n: int) -> None:
        self.blocks = BlockManager(n, BS)

    def apply(self, plan: StepPlan) -> None:
        for sid in plan.free_seq_ids:
            self.blocks.free(sid)
        for sid, slots in zip(plan.seq_ids, plan.num_slots):
            assert self.blocks.allocate_slots(sid, slots), "worker pool out of blocks"


def serve(specs, fails: Callable[[ScheduledStep], bool], *, sent_before_failing: bool = True, max_num_seqs: int = 64,
          num_blocks: int = 400, max_steps: int = 2000):
    """Serve ``specs`` [(seq id, prompt length, max_tokens)] one step at a time (k = 0: each
    step emits the true next token); a step for which ``fails`` holds raises instead.
    ``sent_before_failing``: the failed plan reached the worker (it failed computing) or
    not (it could not be sent). Returns the sequences, the failed steps and the culprits."""
    sched = Scheduler(CacheConfig(block_size=BS, max_num_seqs=max_num_seqs), SpeculationConfig(proposer="none"),
                      256, BlockManager(num_blocks, BS))
    pool = Pool(num_blocks)
    seqs = [make_seq(sid, prompt_for(sid, n), m) for sid, n, m in specs]
    for s in seqs:
        sched.add(s)
    failed_steps, culprits = [], []
    for _ in range(max_steps):
        if not sched.has_work:
            break
        step = sched.schedule()
        assert step is not None
        plan = step.target_plans[0]
        if fails(step):
            if sent_before_failing:
                pool.apply(plan)
            failed_steps.append([s.seq_id for s in step.seqs])
            culprit = sched.step_failed(step)
            if culprit is not None:
                assert culprit.finished and culprit.finish_reason == "error"
                culprits.append(culprit.seq_id)
        else:
            pool.apply(plan)
            # Once a plan is applied, the worker holds exactly what the driver's mirror holds.
            mirror = sched.target_pools[0]
            assert pool.blocks.num_used_blocks == mirror.num_used_blocks
            assert all(len(pool.blocks.block_table(s.seq_id)) == len(mirror.block_table(s.seq_id))
                       for s in sched.running)
            sched.update(StepOutcome(step, [Verdict(s.seq_id, 0, 0, (true_next(s.tokens),)) for s in step.seqs]))
        sched.check_integrity()
    assert not sched.has_work, "the runtime never finished"
    assert sched.target_pools[0].num_used_blocks == 0
    return seqs, failed_steps, culprits


SPECS = [(sid, 3 + sid % 4, 6 + sid % 5) for sid in range(1, 9)]


def carries(sid: int) -> Callable[[ScheduledStep], bool]:
    return lambda step: any(s.seq_id == sid for s in step.seqs)


@pytest.mark.parametrize("sent", [True, False])
@pytest.mark.parametrize("bad", [1, 5, 8])
def test_only_the_request_that_fails_its_steps_fails(bad, sent):
    seqs, failed, culprits = serve(SPECS, carries(bad), sent_before_failing=sent)
    assert culprits == [bad]
    # The whole step, then one half per level down to the culprit alone.
    assert len(failed) == 1 + math.ceil(math.log2(len(SPECS)))
    assert failed[0] == [s for s, _, _ in SPECS] and failed[-1] == [bad]
    for s, (sid, n, m) in zip(seqs, SPECS):
        if sid != bad:
            assert (s.output_tokens, s.finish_reason) == reference(prompt_for(sid, n), m)


def test_two_bad_requests_are_both_found_and_nothing_else_fails():
    bad = {2, 7}
    seqs, failed, culprits = serve(SPECS, lambda step: bool(bad & {s.seq_id for s in step.seqs}))
    assert sorted(culprits) == sorted(bad)
    for s, (sid, n, m) in zip(seqs, SPECS):
        if sid not in bad:
            assert (s.output_tokens, s.finish_reason) == reference(prompt_for(sid, n), m)


def test_a_fault_of_every_step_fails_every_request_and_ends():
    seqs, failed, culprits = serve(SPECS, lambda step: True)
    assert sorted(culprits) == [s for s, _, _ in SPECS]
    assert len(failed) == 2 * len(SPECS) - 1          # every node of the halving tree, once
    assert all(s.finish_reason == "error" and s.output_tokens == [] for s in seqs)


def test_a_fault_of_large_steps_only_is_outlived_by_the_probes():
    """No request is to blame (any step of two or more fails): each probe of one passes
    and emits, so every request still ends with its own output."""
    seqs, failed, culprits = serve(SPECS, lambda step: len(step.seqs) > 1)
    assert culprits == [] and failed
    for s, (sid, n, m) in zip(seqs, SPECS):
        assert (s.output_tokens, s.finish_reason) == reference(prompt_for(sid, n), m)


def test_a_request_failing_later_fails_alone_with_the_others_kept():
    """Its fault starts at its fourth output token: the others keep what they emitted."""
    seqs, failed, culprits = serve(SPECS, lambda step: any(s.seq_id == 3 and s.output_len >= 3 for s in step.seqs))
    assert culprits == [3] and seqs[2].output_len == 3
    for s, (sid, n, m) in zip(seqs, SPECS):
        if sid != 3:
            assert (s.output_tokens, s.finish_reason) == reference(prompt_for(sid, n), m)


def test_the_failed_plans_frees_are_sent_again_but_not_for_sequences_running_again():
    def fresh():
        return Scheduler(CacheConfig(block_size=BS), SpeculationConfig(proposer="none"), 256, BlockManager(100, BS))

    sched = fresh()
    b = make_seq(2, [4, 5], 4)
    sched.add(b)
    step = sched.schedule()
    step.target_plans[0].free_seq_ids = [40]     # sequence 40 ended before this step
    assert sched.step_failed(step) is b          # it ran b alone: b is the culprit
    assert sched._target_frees[0] == [40, 2]     # 40 told again (the plan may never have arrived), then b
    assert not sched.has_work and sched.target_pools[0].num_used_blocks == 0

    sched = fresh()
    for sid in (3, 4):
        sched.add(make_seq(sid, [1, sid], 4))
    step = sched.schedule()
    sched.add(make_seq(9, [7], 3))
    assert [s.seq_id for s in sched.schedule(in_flight=frozenset({3, 4})).seqs] == [9]   # another group
    # As if 9 had been preempted while the failed step was planned: its free rode with that plan.
    step.target_plans[0].free_seq_ids = [9]
    assert sched.step_failed(step) is None
    assert sorted(sched._target_frees[0]) == [3, 4]     # the requeued sequences; 9 runs again: its new KV stays
    assert sched.quarantine.groups == [[3], [4]]


def test_quarantine_probes_the_first_live_group_and_clears_what_passes():
    q = Quarantine()
    assert not q and q.probe({1, 2}) is None
    assert q.failed([1, 2, 3, 4, 5]) is None
    assert q.groups == [[1, 2, 3], [4, 5]]
    assert q.probe({2, 3, 4, 5}) == {2, 3}        # 1 ended meanwhile
    q.passed([2, 3])
    assert q.probe({4, 5}) == {4, 5}
    assert q.failed([4, 5]) is None and q.groups == [[4], [5]]
    assert q.probe({4, 5}, busy=frozenset({4})) == {5}      # [4] is probed by the other group in flight
    assert q.probe({4, 5}, busy=frozenset({4, 5})) is None
    assert q.failed([4]) == 4 and q.groups == [[5]]
    q.passed([5])
    assert not q
