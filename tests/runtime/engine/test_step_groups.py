"""Two groups in flight (``GroupEngine``): the same outputs as one step at a time, with
admissions joining groups, preemptions under KV pressure, seeded sampling and a draft
worker lost with both groups in flight; and through Ray, the actor layout's outputs equal
transformers' greedy ``generate``."""

from __future__ import annotations

import pytest
import torch
from specray_testing import hf_greedy

from specray import RuntimeConfig, SamplingParams, SpecRuntime
from specray.runtime.driver.core import DriverCore
from specray.runtime.engine.step_groups import GroupEngine
from specray.runtime.transport.worker_call import LocalCall, WorkerLost

PROMPTS = [torch.randint(0, 97, (3 + i % 5,), generator=torch.Generator().manual_seed(40 + i)).tolist()
           for i in range(10)]


def config(llama_pair, **kw) -> RuntimeConfig:
    t, d = llama_pair
    return RuntimeConfig(target=t, draft=d, num_speculative_tokens=3, block_size=4, device="cpu", dtype="float32",
                         **kw)


def grouped(drv: DriverCore) -> GroupEngine:
    """The driver's engine replaced, before any request, by one keeping two groups in
    flight over the same in-process workers (the order of calls is what groups change)."""
    e = drv.engine
    drv.engine = GroupEngine(drv.scheduler, e.verifiers, e.proposer)
    return drv.engine


def run(cfg: RuntimeConfig, params, groups: bool, prepare=lambda drv: None):
    drv = DriverCore(cfg.replace(layout="colocated"), export_metrics=False)
    try:
        if groups:
            grouped(drv)
        prepare(drv)
        reply = drv.submit(PROMPTS, params if isinstance(params, list) else [params] * len(PROMPTS))
        assert reply.error is None
        outs = drv.wait(reply.request_ids, timeout=300)
        assert outs is not None
        return [o.token_ids for o in outs], drv.metrics(workers=False)
    finally:
        drv.shutdown()


@pytest.mark.parametrize("kw", [dict(max_num_seqs=6), dict(num_kv_blocks=24, max_num_seqs=10)])
def test_greedy_outputs_equal_one_step_at_a_time(llama_pair, kw):
    """``max_num_seqs=6``: requests wait and join whichever group is planned next;
    24 blocks of 4: sequences outgrow the pool and are preempted between groups."""
    cfg = config(llama_pair, **kw)
    params = SamplingParams(max_tokens=40, temperature=0.0)
    serial, _ = run(cfg, params, groups=False)
    got, m = run(cfg, params, groups=True)
    assert got == serial
    assert m["num_group_steps"] > 10
    if "num_kv_blocks" in kw:
        assert m["num_preemptions"] > 0


def test_seeded_samples_equal_one_step_at_a_time(llama_pair):
    cfg = config(llama_pair, max_num_seqs=8)
    params = [SamplingParams(max_tokens=30, temperature=0.9, top_k=20, seed=i) for i in range(len(PROMPTS))]
    serial, _ = run(cfg, params, groups=False)
    got, m = run(cfg, params, groups=True)
    assert got == serial and m["num_group_steps"] > 0


class DyingDraft(LocalCall):
    """A draft worker that dies at its ``at``-th call: that call and the one already sent
    behind it (the other group's) fail, as a dead actor's do; it comes back empty."""

    def __init__(self, call: LocalCall, worker, at: int) -> None:
        super().__init__(call.fn)
        self.worker, self.at, self.calls, self.lost = worker, at, 0, 0

    def submit(self, plan, *args):
        self.calls += 1
        if self.at <= self.calls < self.at + 2:
            if self.calls == self.at:
                self.lost += 1
                self.worker.runner.kv.blocks.reset()     # restarted empty: nothing it held is kept
                self.worker.runner.kv.num_written.clear()
            return WorkerLost("draft worker died")
        return super().submit(plan, *args)

    def wait(self, handle):
        if isinstance(handle, WorkerLost):
            raise handle
        return handle


def test_a_draft_worker_lost_with_both_groups_in_flight_loses_nothing(llama_pair):
    cfg = config(llama_pair, max_num_seqs=10)
    params = SamplingParams(max_tokens=40, temperature=0.0)
    serial, _ = run(cfg, params, groups=False)
    dying = []

    def kill_later(drv):
        call = DyingDraft(drv.engine.proposer.calls[0], drv.pool.local_workers[-1], at=6)
        drv.engine.proposer.calls[0] = call
        dying.append(call)

    got, m = run(cfg, params, groups=True, prepare=kill_later)
    assert got == serial
    assert dying[0].lost == 1 and dying[0].calls > 8      # both in-flight calls failed; drafting resumed
    assert m["num_draft_worker_failures"] == 1            # one death, counted once
    assert m["num_group_steps"] > 0


def test_actor_layout_with_groups_equals_hf_generate(ray_module, llama_pair):
    expected = hf_greedy(llama_pair[0], PROMPTS[:6], 24)
    rt = SpecRuntime(config(llama_pair, layout="actors"))
    try:
        outs = rt.generate(PROMPTS[:6], SamplingParams(max_tokens=24, temperature=0.0))
        m = rt.metrics()
        assert [o.token_ids for o in outs] == expected
        assert m["layout"] == "actors" and m["num_group_steps"] > 0
    finally:
        rt.shutdown()


@pytest.mark.parametrize("worker", ["draft", "target"])
def test_a_group_failing_for_one_request_fails_it_alone(llama_pair, worker):
    """A request whose every step raises (its draft call cannot be sent: the group fails at
    launch; or its verification raises: at landing) while the other group is in flight:
    it alone fails, and the others' seeded samples equal a serial run without it."""
    from specray_testing import MARK, break_steps_of

    cfg = config(llama_pair, max_num_seqs=8)
    params = [SamplingParams(max_tokens=30, temperature=0.9, top_k=20, seed=i) for i in range(len(PROMPTS))]
    want, _ = run(cfg, params, groups=False)
    bad = 4
    drv = DriverCore(cfg.replace(layout="colocated"), export_metrics=False)
    try:
        engine = grouped(drv)
        raised = break_steps_of((engine.proposer.calls if worker == "draft" else engine.verifiers)[0])
        reply = drv.submit(PROMPTS[:bad] + [[1, 2, 3]] + PROMPTS[bad:],
                           params[:bad] + [SamplingParams(max_tokens=30, top_k=MARK)] + params[bad:])
        assert reply.error is None
        ids = reply.request_ids
        outs = drv.wait(ids[:bad] + ids[bad + 1:], timeout=300)
        with pytest.raises(RuntimeError, match="OverflowError"):
            drv.wait([ids[bad]], timeout=60)
        m = drv.metrics(workers=False)
        drv.scheduler.check_integrity()
        assert len(engine.calls) == 0 and engine.flight is None
    finally:
        drv.shutdown()
    assert [o.token_ids for o in outs] == want
    assert raised and m["num_failed_steps"] == len(raised) and m["num_requests_failed"] == 1
    assert m["num_group_steps"] > 0 and m["target_kv_blocks_used"] == [0] and m["draft_kv_blocks_used"] == [0]
