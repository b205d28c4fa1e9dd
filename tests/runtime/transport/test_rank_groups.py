"""A tensor-parallel target through the whole runtime, on one module-scoped runtime: two
data-parallel target groups of two ranks (rank 0 in the driver's process, rank 1 a
``TargetRankActor`` each, gloo on CPU) and a TP-1 draft on an actor of its own.

References: transformers' greedy continuation, token for token, before and after a rank is
SIGKILLed mid-stream with a batch in flight (its group is taken down, formed again, and
its sequences recompute); refusals of splits the model does not divide."""

from __future__ import annotations

import time

import pytest
import torch
from ray._private.state import actors
from specray_testing import hf_greedy, kill_mid_stream

from specray import RuntimeConfig, SamplingParams, SpecRuntime

PROMPTS = [torch.randint(0, 97, (3 + i,), generator=torch.Generator().manual_seed(300 + i)).tolist()
           for i in range(5)]
MAX_TOKENS = 48


def alive_pids(cls: str) -> list[int]:
    return [a["Pid"] for a in actors().values() if a["ActorClassName"] == cls and a["State"] == "ALIVE"]


@pytest.fixture(scope="module")
def expected(llama_pair):
    return hf_greedy(llama_pair[0], PROMPTS, MAX_TOKENS)


@pytest.fixture(scope="module")
def runtime(ray_module, llama_pair):
    t, d = llama_pair
    rt = SpecRuntime(RuntimeConfig(target=t, draft=d, num_speculative_tokens=3, block_size=4, device="cpu",
                                   dtype="float32", layout="actors", num_target_workers=2,
                                   tensor_parallel_size=2, max_worker_restarts=3))
    yield rt
    rt.shutdown()


def greedy(n: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0)


def test_dp2_x_tp2_with_a_draft_actor_equals_transformers(runtime, expected):
    outs = runtime.generate(PROMPTS, greedy())
    assert [o.token_ids for o in outs] == expected
    m = runtime.metrics()
    assert m["tensor_parallel_size"] == 2 and m["num_target_workers"] == 2
    assert m["num_accepted_tokens"] > 0
    assert len(alive_pids("TargetRankActor")) == 2


def test_sigkill_of_a_rank_mid_stream_loses_nothing(runtime, expected):
    (victim, *_) = alive_pids("TargetRankActor")
    assert kill_mid_stream(runtime, victim, PROMPTS, greedy()) == expected
    assert runtime.metrics()["num_target_worker_failures"] >= 1
    # The group formed again (a new rank actor) and serves.
    deadline = time.time() + 60
    while victim in alive_pids("TargetRankActor") or len(alive_pids("TargetRankActor")) < 2:
        assert time.time() < deadline
        time.sleep(0.5)
    outs = runtime.generate(PROMPTS[:2], greedy(16))
    assert [o.token_ids for o in outs] == [e[:16] for e in expected[:2]]


def test_colocated_tp2_equals_transformers(ray_module, llama_pair, expected):
    """The co-located layout: draft and the target's rank 0 in the driver's process."""
    t, d = llama_pair
    rt = SpecRuntime(RuntimeConfig(target=t, draft=d, num_speculative_tokens=3, block_size=4, device="cpu",
                                   dtype="float32", layout="colocated", tensor_parallel_size=2))
    try:
        outs = rt.generate(PROMPTS[:3], greedy(24))
        assert [o.token_ids for o in outs] == [e[:24] for e in expected[:3]]
        assert rt.metrics()["tensor_parallel_size"] == 2
    finally:
        rt.shutdown()


def test_a_tp2_draft_proposes_and_survives_a_rank_death(ray_module, llama_pair, expected):
    """draft_tensor_parallel_size=2: the draft actor is rank 0 and starts its other rank.
    A SIGKILLed draft rank takes the draft actor down; Ray restarts it with a new rank, the
    target decodes alone meanwhile: the tokens do not change."""
    t, d = llama_pair
    rt = SpecRuntime(RuntimeConfig(target=t, draft=d, num_speculative_tokens=3, block_size=4, device="cpu",
                                   dtype="float32", draft_tensor_parallel_size=2, max_worker_restarts=2))
    try:
        m = rt.metrics()
        assert m["layout"] == "actors" and m["draft_tensor_parallel_size"] == 2
        (victim,) = alive_pids("DraftRankActor")
        assert kill_mid_stream(rt, victim, PROMPTS, greedy()) == expected
        assert rt.metrics()["num_draft_worker_failures"] >= 1
        deadline = time.time() + 90
        while not (alive_pids("DraftRankActor") and victim not in alive_pids("DraftRankActor")):
            assert time.time() < deadline
            time.sleep(0.5)
        # The new draft actor answers once its ranks have loaded: until then the target
        # decodes alone. Then its group proposes again.
        before = rt.metrics()["num_accepted_tokens"]
        while rt.metrics()["num_accepted_tokens"] == before:
            assert time.time() < deadline + 60
            outs = rt.generate(PROMPTS[:2], greedy(16))
            assert [o.token_ids for o in outs] == [e[:16] for e in expected[:2]]
    finally:
        rt.shutdown()


def test_splits_the_model_does_not_divide_are_refused(llama_pair):
    from specray.runtime.settled import settle

    t, d = llama_pair
    cfg = RuntimeConfig(target=t, draft=d, device="cpu", layout="colocated", tensor_parallel_size=3)
    with pytest.raises(ValueError, match="tensor_parallel_size=3: num_key_value_heads 2 is fewer"):
        settle(cfg)
    with pytest.raises(ValueError, match="tensor_parallel_size=2 needs the native executor"):
        RuntimeConfig(target=t, draft=d, executor="transformers", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="tensor_parallel_size must be an int >= 1"):
        RuntimeConfig(target=t, draft=d, tensor_parallel_size=0)
    with pytest.raises(ValueError, match="draft_tensor_parallel_size=2 runs the draft on actors"):
        RuntimeConfig(target=t, draft=d, layout="colocated", draft_tensor_parallel_size=2)
    with pytest.raises(ValueError, match="draft_tensor_parallel_size=2 needs a draft model"):
        RuntimeConfig(target=t, proposer="ngram", draft_tensor_parallel_size=2)
    with pytest.raises(ValueError, match="draft_tensor_parallel_size=3: num_key_value_heads 2"):
        settle(RuntimeConfig(target=t, draft=d, device="cpu", layout="actors", draft_tensor_parallel_size=3))


def test_more_ranks_than_the_node_holds_are_refused(ray_module, llama_pair):
    from specray.runtime.transport.rank_groups import RankSet
    from specray.scheduler.config import CacheConfig
    from specray.workers.config import ModelConfig

    # The test Ray has 2 CPUs: two ranks asking for 2 each do not fit its node.
    with pytest.raises(ValueError, match="tensor_parallel_size=2: rank 0's node has 2 CPUs, its ranks ask for 4"):
        RankSet("target", ModelConfig(target=llama_pair[0], device="cpu"), CacheConfig(), 2,
                {"num_cpus": 2, "num_gpus": 0}, 5.0, 5.0)
