"""Workers killed mid-generation (SIGKILL of their processes): every request finishes with
the undisturbed greedy output. Without its draft worker the driver decodes on the target
alone and resumes speculation once Ray has restarted it; the sequences of a dead target
worker are requeued with their tokens and recomputed on the restarted one."""

from __future__ import annotations

import time

import pytest
import torch
from ray._private.state import actors
from specray_testing import hf_greedy, kill_mid_stream

from specray import RuntimeConfig, SamplingParams, SpecRuntime


def alive_pids(cls: str) -> list[int]:
    return [a["Pid"] for a in actors().values() if a["ActorClassName"] == cls and a["State"] == "ALIVE"]


PROMPTS = [torch.randint(0, 97, (4 + i,), generator=torch.Generator().manual_seed(200 + i)).tolist()
           for i in range(6)]


@pytest.fixture(scope="module")
def expected(llama_pair):
    """The undisturbed reference: transformers' greedy output for every prompt."""
    return hf_greedy(llama_pair[0], PROMPTS, 160)


def start_runtime(llama_pair, **kw) -> SpecRuntime:
    """The actor layout: the draft on an actor of its own, the first target worker in the
    driver's process, any further one on an actor."""
    t, d = llama_pair
    return SpecRuntime(RuntimeConfig(target=t, draft=d, num_speculative_tokens=3, block_size=4, device="cpu",
                                     dtype="float32", layout="actors", **kw))


def kill_mid_generation(rt: SpecRuntime, victim: int) -> list[list[int]]:
    return kill_mid_stream(rt, victim, PROMPTS, SamplingParams(max_tokens=160, temperature=0.0))


def test_sigkill_of_the_draft_worker_changes_no_output(ray_session, llama_pair, expected):
    """Over its link (the default): the dead worker's link is closed, and a new one is
    opened once Ray has restarted it. (Over Ray actor calls, the next test.)"""
    rt = start_runtime(llama_pair, max_worker_restarts=2)
    try:
        (victim,) = alive_pids("DraftActor")
        assert kill_mid_generation(rt, victim) == expected
        m = rt.metrics()
        assert m["num_draft_worker_failures"] >= 1
        assert m["num_group_steps"] > 0            # it died with two groups in flight
        # Ray restarted it (a new process) and speculation resumed.
        deadline = time.time() + 60
        while not (alive_pids("DraftActor") and alive_pids("DraftActor")[0] != victim) and time.time() < deadline:
            time.sleep(0.5)
        assert alive_pids("DraftActor") and alive_pids("DraftActor")[0] != victim
        # The idle driver notices by itself; no request is needed for that.
        while rt.metrics()["draft_workers_down"] and time.time() < deadline:
            time.sleep(0.2)
        assert rt.metrics()["draft_workers_down"] == []
        before = rt.metrics()["num_draft_tokens"]
        again = rt.generate(PROMPTS[:2], SamplingParams(max_tokens=40, temperature=0.0))
        assert [o.token_ids for o in again] == [e[:40] for e in expected[:2]]
        after = rt.metrics()
        assert after["num_draft_tokens"] > before and after["draft_workers_down"] == []
        # The draft's; the target is in the driver.
        assert after["num_linked_workers"] == 1
    finally:
        rt.shutdown()


def test_sigkill_of_the_target_worker_changes_no_output(ray_session, llama_pair, expected):
    """The second target worker (the first lives in the driver's process) dies, its calls
    on its link."""
    rt = start_runtime(llama_pair, max_worker_restarts=2, num_target_workers=2)
    try:
        assert rt.metrics()["num_linked_workers"] == 2          # the draft's link and the target actor's
        (victim,) = alive_pids("TargetActor")
        assert kill_mid_generation(rt, victim) == expected
        m = rt.metrics()
        assert m["num_target_worker_failures"] >= 1
        assert m["num_group_steps"] > 0
        assert m["num_preemptions"] >= 1          # its sequences were requeued and recomputed
        # The other target worker served meanwhile; the idle driver notices the restart.
        deadline = time.time() + 60
        while rt.metrics()["target_workers_down"] and time.time() < deadline:
            time.sleep(0.2)
        assert rt.metrics()["target_workers_down"] == []
        assert alive_pids("TargetActor") and alive_pids("TargetActor")[0] != victim
    finally:
        rt.shutdown()


def actor_states(cls: str) -> list[str]:
    return [a["State"] for a in actors().values() if a["ActorClassName"] == cls]


def test_a_draft_worker_past_its_restarts_is_reported_dead_and_decoding_goes_on(ray_session, llama_pair, expected):
    """Over Ray actor calls (no link)."""
    rt = start_runtime(llama_pair, max_worker_restarts=0, worker_link=False)
    try:
        assert rt.metrics()["num_linked_workers"] == 0
        (victim,) = alive_pids("DraftActor")
        assert kill_mid_generation(rt, victim) == expected
        m = rt.metrics()
        assert m["draft_workers_dead"] == [0] and m["draft_workers_down"] == [0]
        assert m["target_workers_dead"] == []
        assert "DEAD" in actor_states("DraftActor") and not alive_pids("DraftActor")   # Ray agrees
        again = rt.generate(PROMPTS[:2], SamplingParams(max_tokens=40, temperature=0.0))
        assert [o.token_ids for o in again] == [e[:40] for e in expected[:2]]
        assert rt.metrics()["num_draft_tokens"] == m["num_draft_tokens"]     # plain decoding from now on
    finally:
        rt.shutdown()
