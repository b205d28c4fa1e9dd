"""The client handle through real Ray actors (the actor layout: the draft on an actor of
its own, reached over its link): generate, stream, metrics, bad input, connect by name,
metrics on Ray's Prometheus endpoint, shutdown and restart."""

from __future__ import annotations

import time
import urllib.request

import pytest
import torch
from specray_testing import hf_greedy, run_local

from specray import RequestOutput, RuntimeConfig, SamplingParams, SpecRuntime

MAX_LEN = 64


@pytest.fixture(scope="module")
def rt(ray_module, llama_pair):
    t, d = llama_pair
    runtime = SpecRuntime(RuntimeConfig(target=t, draft=d, num_speculative_tokens=3, block_size=4,
                                        device="cpu", dtype="float32", max_model_len=MAX_LEN, name="specray-test",
                                        layout="actors"))
    yield runtime
    runtime.shutdown()


def some_prompts(n=8):
    return [torch.randint(0, 97, (3 + 2 * i,), generator=torch.Generator().manual_seed(i)).tolist() for i in range(n)]


def test_generate_through_ray_equals_hf(rt, llama_pair):
    ps = some_prompts()
    outs = rt.generate(ps, SamplingParams(max_tokens=20, temperature=0.0))
    assert all(isinstance(o, RequestOutput) for o in outs)
    assert [o.token_ids for o in outs] == hf_greedy(llama_pair[0], ps, 20)
    assert [o.prompt_token_ids for o in outs] == ps
    m = rt.metrics()
    for key in ("acceptance_rate", "mean_accepted_length", "system_efficiency", "num_draft_tokens",
                "num_accepted_tokens", "tokens_per_s", "num_preemptions"):
        assert key in m
    assert m["num_draft_tokens"] > 0 and 0 < m["acceptance_rate"] <= 1
    assert 1 <= m["mean_accepted_length"] <= 4
    assert m["system_efficiency"] == pytest.approx(m["mean_accepted_length"] / 4)
    # The step breakdown adds up, and actor hops show as messaging, not as compute.
    parts = ("schedule_s", "merge_s", "draft_s", "verify_s", "driver_overhead_s")
    assert sum(m[k] for k in parts) == pytest.approx(m["busy_s"], rel=1e-6)
    assert 0 < m["draft_compute_s"] <= m["draft_s"] and 0 < m["verify_compute_s"] <= m["verify_s"]
    hops = m["draft_s"] - m["draft_compute_s"] + m["verify_s"] - m["verify_compute_s"]
    assert m["messaging_s"] == pytest.approx(hops)
    assert m["messaging_s"] > 0 and m["merge_s"] > 0
    assert m["mean_overhead_s"] * m["num_steps"] == pytest.approx(
        m["busy_s"] - m["draft_compute_s"] - m["verify_compute_s"], rel=1e-6)


def test_samples_through_the_draft_actor_equal_the_in_process_path(rt, llama_pair):
    """The module's draft runs on an actor reached over its link (draft probabilities
    travel by value): seeded samples equal an in-process driver's."""
    t, d = llama_pair
    ps = some_prompts()
    sampled = [SamplingParams(max_tokens=16, temperature=0.9, seed=i) for i in range(len(ps))]
    local, _ = run_local(RuntimeConfig(target=t, draft=d, num_speculative_tokens=3, block_size=4, device="cpu",
                                       dtype="float32", max_model_len=MAX_LEN), ps, sampled)
    assert [o.token_ids for o in rt.generate(ps, sampled)] == [o.token_ids for o in local]
    assert rt.metrics()["num_linked_workers"] == 1     # the draft's; the target lives in the driver


def test_stream_yields_increments_that_add_up(rt):
    p = some_prompts()[3]
    params = SamplingParams(max_tokens=17, temperature=0.0)
    (full,) = rt.generate([p], params)
    deltas = list(rt.stream(p, params))
    assert sum((d.token_ids for d in deltas), []) == full.token_ids
    assert all(d.finish_reason is None for d in deltas[:-1])
    assert deltas[-1].finish_reason == "length"
    assert len(deltas) > 1


BAD = [
    ([[1, 2, 97]], SamplingParams(max_tokens=4), "prompt"),
    ([[]], SamplingParams(max_tokens=4), "prompt"),
    ([""], SamplingParams(max_tokens=4), "prompt"),
    ([list(range(MAX_LEN))], SamplingParams(max_tokens=4), "max_model_len"),
    ([[1, 2], "text without a tokenizer"], SamplingParams(max_tokens=4), "tokenizer"),
    ([[1, 2]], SamplingParams(max_tokens=4, stop_token_ids=[500]), "stop_token_ids"),
]


@pytest.mark.parametrize("prompts,params,field", BAD)
def test_bad_request_raises_value_error_naming_the_field(rt, prompts, params, field):
    with pytest.raises(ValueError, match=field):
        rt.generate(prompts, params)
    # ... and the same runtime keeps serving.
    (ok,) = rt.generate([[1, 2, 3]], SamplingParams(max_tokens=3, temperature=0.0))
    assert len(ok.token_ids) == 3


@pytest.mark.parametrize("field,value", [("max_tokens", 0), ("temperature", -0.5), ("top_p", 0.0),
                                         ("top_p", 1.5), ("top_k", -1)])
def test_bad_sampling_params_are_refused_client_side_and_by_the_driver(rt, field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})
    # A caller that bypasses construction-time checks is caught by the driver, with the
    # request index, before anything is admitted.
    p = SamplingParams(max_tokens=3)
    object.__setattr__(p, field, value)
    with pytest.raises(ValueError, match=rf"request 1: .*{field}"):
        rt.generate([[1, 2], [3, 4]], [SamplingParams(max_tokens=3), p])
    assert rt.metrics()["num_waiting"] == 0


def test_connect_by_name(rt):
    other = SpecRuntime.connect(name="specray-test")
    (a,) = other.generate([[4, 5, 6]], SamplingParams(max_tokens=5, temperature=0.0))
    (b,) = rt.generate([[4, 5, 6]], SamplingParams(max_tokens=5, temperature=0.0))
    assert a.token_ids == b.token_ids
    with pytest.raises(ValueError, match="no specray driver named"):
        SpecRuntime.connect(name="no-such-driver")


def test_shutdown_then_a_second_runtime_starts_cleanly(ray_session, llama_pair):
    t, _ = llama_pair
    for layout in ("colocated", "actors"):   # the n-gram proposer runs in the driver, beside the target
        r = SpecRuntime(RuntimeConfig(target=t, proposer="ngram", block_size=4, device="cpu", dtype="float32",
                                      layout=layout))
        (o,) = r.generate([[7, 8, 9, 7, 8]], SamplingParams(max_tokens=6, temperature=0.0))
        assert len(o.token_ids) == 6
        r.shutdown()


def test_a_refused_config_leaves_no_worker_behind(ray_session, tmp_path):
    """Workers start while the driver reads the configs: a driver that then refuses its
    configuration (here a draft with another tokenizer) releases the workers it started."""
    from ray._private.state import actors
    from specray_testing import disagreeing_pair

    def alive() -> list[str]:
        return sorted(a["ActorClassName"] for a in actors().values()
                      if a["State"] == "ALIVE" and a["ActorClassName"] in ("DraftActor", "TargetActor", "Driver"))

    t, other_draft = disagreeing_pair(tmp_path)
    before = alive()
    with pytest.raises(ValueError, match="do not share a tokenizer"):
        SpecRuntime(RuntimeConfig(target=t, draft=other_draft, block_size=4, device="cpu", dtype="float32"))
    deadline = time.time() + 30
    while alive() != before and time.time() < deadline:
        time.sleep(0.5)
    assert alive() == before


def test_a_start_called_off_stops_waiting_and_releases_its_workers(ray_session, llama_pair):
    """A start waiting for its workers (here a target that can never be scheduled; in
    life, one loading a large model) stops when called off, instead of waiting on, and
    leaves no worker behind."""
    import threading

    from ray._private.state import actors

    from specray.runtime.settled import settle
    from specray.runtime.transport.worker_pool import StartCancelled, start_workers

    def alive() -> list[str]:
        return sorted(a["ActorClassName"] for a in actors().values()
                      if a["State"] != "DEAD" and a["ActorClassName"] in ("DraftActor", "TargetActor"))

    t, d = llama_pair
    # The actor layout's second target worker is an actor; the first loads in this process.
    cfg = settle(RuntimeConfig(target=t, draft=d, block_size=4, device="cpu", dtype="float32", layout="actors",
                               num_target_workers=2, target_resources={"no_such_resource": 1}))
    before = alive()
    cancel, raised = threading.Event(), []

    def start():
        try:
            start_workers(cfg, cancel)
        except BaseException as e:
            raised.append(e)

    starter = threading.Thread(target=start)
    starter.start()
    try:
        deadline = time.time() + 60
        while len(alive()) < len(before) + 2 and time.time() < deadline:
            time.sleep(0.2)
        assert alive() == sorted(before + ["DraftActor", "TargetActor"])   # one up, one pending
    finally:
        cancel.set()
        starter.join(timeout=60)
    assert not starter.is_alive()
    assert len(raised) == 1 and isinstance(raised[0], StartCancelled)
    deadline = time.time() + 30
    while alive() != before and time.time() < deadline:
        time.sleep(0.2)
    assert alive() == before


def test_metrics_reach_rays_prometheus_endpoint(rt, ray_module):
    """The driver's metrics on Ray's metrics API, and their values moving with traffic:
    the exported counter catches up with what metrics() counted after each request."""
    port = ray_module._private.worker.global_worker.node.metrics_export_port

    def scrape() -> dict[str, float]:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        out = {}
        for line in text.splitlines():
            if line.startswith("ray_specray_") and 'driver="specray-test"' in line and "worker=" not in line:
                out[line.split("{")[0]] = float(line.rsplit(" ", 1)[1])
        return out

    def wait_for(count: int) -> dict[str, float]:
        got: dict[str, float] = {}
        deadline = time.time() + 60
        while time.time() < deadline:
            got = scrape()
            if got.get("ray_specray_num_emitted_tokens_total", 0) >= count:
                return got
            time.sleep(1)
        raise AssertionError(f"the exported token count never reached {count}: {got}")

    rt.generate([[1, 2, 3]], SamplingParams(max_tokens=8, temperature=0.0))
    first = wait_for(rt.metrics()["num_emitted_tokens"])
    for name in ("acceptance_rate", "mean_proposal_len", "mean_overhead_s", "acceptance_by_position"):
        assert f"ray_specray_{name}" in first, (name, first)
    rt.generate([[4, 5, 6]], SamplingParams(max_tokens=8, temperature=0.0))
    assert wait_for(rt.metrics()["num_emitted_tokens"])["ray_specray_num_emitted_tokens_total"] \
        > first["ray_specray_num_emitted_tokens_total"]


def test_generate_takes_more_prompts_than_max_pending(ray_session, llama_pair):
    """One offline call of 11 prompts to a driver that holds 4: fed as room frees, outputs
    in input order, equal to transformers'; a bad prompt anywhere refuses the whole call
    before any part of it runs."""
    t, d = llama_pair
    r = SpecRuntime(RuntimeConfig(target=t, draft=d, num_speculative_tokens=3, block_size=4, device="cpu",
                                  dtype="float32", max_model_len=MAX_LEN, max_pending=4, layout="colocated"))
    try:
        ps = some_prompts(11)
        outs = r.generate(ps, SamplingParams(max_tokens=6, temperature=0.0), use_tqdm=True)
        assert [o.prompt_token_ids for o in outs] == ps
        assert [o.token_ids for o in outs] == hf_greedy(t, ps, 6)
        assert r.metrics()["num_requests_finished"] == 11
        with pytest.raises(ValueError, match="request 9: prompt token id 97 is outside"):
            r.generate(ps[:9] + [[1, 97]], SamplingParams(max_tokens=6))
        assert r.metrics()["num_requests_finished"] == 11 and r.metrics()["num_requests_held"] == 0
    finally:
        r.shutdown()


CONNECT = """
import sys, time, warnings
from specray import SpecRuntime
t0 = time.monotonic()
try:
    SpecRuntime.connect(ray_address=sys.argv[1], timeout_s=2)
except ValueError as e:
    print("ValueError:", e)
print("elapsed", time.monotonic() - t0)
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    try:
        SpecRuntime.connect(address=sys.argv[1], timeout_s=1)
    except ValueError as e:
        print("old name:", e, [str(x.message) for x in w])
try:
    SpecRuntime.connect(ray_address="127.0.0.1:1", address="127.0.0.1:2")
except ValueError as e:
    print("both:", e)
"""


def test_connect_to_a_wrong_address_fails_soon_with_a_clear_error(tmp_path):
    """A closed port on this machine: no cluster answers. The wait is bounded by
    timeout_s (Ray's own init would retry for minutes), and the error names ray_address."""
    import os
    import subprocess
    import sys

    from specray_testing import free_port

    address = f"127.0.0.1:{free_port()}"
    env = dict(os.environ, RAY_TMPDIR=str(tmp_path))
    env.pop("RAY_ADDRESS", None)
    p = subprocess.run([sys.executable, "-c", CONNECT, address], env=env, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    assert f"ValueError: ray_address '{address}': no Ray cluster answers at {address} within 2 s" in p.stdout
    assert float(p.stdout.split("elapsed ")[1].split()[0]) < 60
    assert f"old name: ray_address '{address}': no Ray cluster answers" in p.stdout
    assert "deprecated: use ray_address=" in p.stdout
    assert "both: give ray_address only" in p.stdout


def test_auto_names_the_clusters_it_cannot_choose_between(monkeypatch):
    from ray._private import services

    from specray.runtime import ray_env

    monkeypatch.setattr(services, "find_gcs_addresses", lambda: {"10.0.0.1:6379", "10.0.0.2:6379"})
    with pytest.raises(ValueError, match=r"ray_address='auto': 2 Ray clusters run on this machine "
                                         r"\(10.0.0.1:6379, 10.0.0.2:6379\)"):
        ray_env.resolve("auto")
    monkeypatch.setattr(services, "find_gcs_addresses", lambda: set())
    with pytest.raises(ValueError, match="no Ray cluster runs on this machine"):
        ray_env.resolve("auto")
    monkeypatch.setattr(services, "find_gcs_addresses", lambda: {"10.0.0.3:6379"})
    assert ray_env.resolve("auto") == "10.0.0.3:6379" and ray_env.resolve("h:1") == "h:1"
    with pytest.raises(ValueError, match="is a dashboard URL"):
        ray_env.join("http://127.0.0.1:8265", None, 1)
    with pytest.raises(ValueError, match="not host:port"):
        ray_env.wait_reachable("nohost", 1)
