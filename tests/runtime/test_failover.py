"""The driver actor SIGKILLed mid-generation (its process, as the OOM killer or a lost node
would end it): Ray restarts it, the client handle resumes every accepted request from
the output it holds, and every output equals the run without the kill, token for token,
greedy and seeded sampling alike (the built-in pair: a real tokenizer, so texts, stop
strings and logprobs are checked too). Then the runtime serves on, and ``shutdown()``
leaves nothing running."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import ray
from ray._private.state import actors
from ray.util.placement_group import placement_group_table

import specray
from specray import RuntimeConfig, SamplingParams, SpecRuntime

PROMPTS = ["def add(a, b):", "import os\n", "class Stack:\n", "for i in range(10):", "# a comment\n",
           "while True:\n", "x = [1, 2, 3]\n", "print('hello')\n", "def main():\n", "if __name__ ==",
           "return self.", "try:\n    "]
GREEDY = SamplingParams(max_tokens=40, temperature=0.0)
SAMPLED = [SamplingParams(max_tokens=40, temperature=0.9, top_p=0.95, seed=100 + i) for i in range(12)]
STREAMED = SamplingParams(max_tokens=60, temperature=0.8, seed=7, logprobs=2, stop=["\n\n\n"])
UNSEEDED = SamplingParams(max_tokens=60, temperature=0.8)


def config(**kw) -> RuntimeConfig:
    return RuntimeConfig(target=specray.builtin_model("tiny-target"), draft=specray.builtin_model("tiny-draft"),
                         num_speculative_tokens=3, device="cpu", dtype="float32", name="specray-failover",
                         **kw)


# What other test modules left running is not this module's business.
BEFORE: dict[str, set] = {"actors": set(), "groups": set()}


def alive(cls: str) -> list[dict]:
    return [a for a in actors().values() if a["ActorClassName"] == cls and a["State"] == "ALIVE"
            and a["ActorID"] not in BEFORE["actors"]]


def live_groups() -> int:
    return sum(1 for gid, g in placement_group_table().items() if g["state"] != "REMOVED"
               and gid not in BEFORE["groups"])


def kill_driver(rt: SpecRuntime) -> int:
    pid = ray.get(rt._driver.pid.remote())
    os.kill(pid, signal.SIGKILL)
    return pid


def kill_again_while_starting(rt: SpecRuntime, old: int, timeout: float = 60.0) -> int:
    """SIGKILL the restarted driver as soon as its process exists (it is still starting
    its workers, or resuming): a kill during recovery."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        a = actors(rt._driver._actor_id.hex())
        if a and a["Pid"] not in (0, old) and a["State"] != "DEAD":
            os.kill(a["Pid"], signal.SIGKILL)
            return a["Pid"]
        time.sleep(0.02)
    raise AssertionError("the driver was not restarted")


def run_all(rt: SpecRuntime, kill=None) -> tuple[list, list]:
    """The batch (12 greedy, 12 seeded samples) and a stream, side by side; ``kill`` runs
    once the stream has yielded a few tokens. Returns (batch outputs, stream deltas)."""
    batch: list = []
    failed: list[BaseException] = []

    def generate():
        try:
            batch.extend(rt.generate(PROMPTS + PROMPTS, [GREEDY] * 12 + SAMPLED))
        except BaseException as e:  # noqa: BLE001 - re-raised in the test's thread
            failed.append(e)

    t = threading.Thread(target=generate)
    t.start()
    deltas = []
    for d in rt.stream("def fibonacci(n):", STREAMED):
        deltas.append(d)
        if kill is not None and sum(len(x.token_ids) for x in deltas) >= 6:
            kill()
            kill = None
    t.join(timeout=300)
    if failed:
        raise failed[0]
    return batch, deltas


def joined(deltas) -> tuple:
    toks = [t for d in deltas for t in d.token_ids]
    return toks, "".join(d.text for d in deltas), deltas[-1].finish_reason


def same_stream(a, b) -> None:
    """Tokens, text and finish equal; logprobs one per token, the same alternatives, and
    equal to float rounding (the resumed driver computed the KV in one prefill, the
    uninterrupted one step by step)."""
    assert joined(a) == joined(b)
    la = [lp for d in a for lp in d.logprobs]
    lb = [lp for d in b for lp in d.logprobs]
    assert [x.token_id for x in la] == [x.token_id for x in lb]
    assert [[t for t, _ in x.top] for x in la] == [[t for t, _ in x.top] for x in lb]
    assert [x.logprob for x in la] == pytest.approx([x.logprob for x in lb], abs=1e-4)


def same(a, b) -> None:
    assert [(o.token_ids, o.text, o.finish_reason, o.prompt_token_ids) for o in a] == \
        [(o.token_ids, o.text, o.finish_reason, o.prompt_token_ids) for o in b]


@pytest.fixture(scope="module")
def rt(ray_module):
    BEFORE["actors"] = {a["ActorID"] for a in actors().values() if a["State"] != "DEAD"}
    BEFORE["groups"] = {gid for gid, g in placement_group_table().items() if g["state"] != "REMOVED"}
    # Resources ask for a placement group: the test sees it go with each dead driver. The
    # actor layout: the driver's process hosts the target, the draft is an actor of its own.
    runtime = SpecRuntime(config(max_driver_restarts=8, target_resources={"CPU": 0.1},
                                 draft_resources={"CPU": 0.1}, layout="actors"))
    yield runtime
    runtime.shutdown()


@pytest.fixture(scope="module")
def reference(rt):
    return run_all(rt)


def test_a_killed_driver_resumes_every_request_with_the_same_tokens(rt, reference):
    ref_batch, ref_stream = reference
    pid = ray.get(rt._driver.pid.remote())
    batch, stream = run_all(rt, kill=lambda: kill_driver(rt))
    assert ray.get(rt._driver.pid.remote()) != pid
    same(batch, ref_batch)
    same_stream(stream, ref_stream)
    # The caller saw one request: its first id, its prompt.
    assert len({d.request_id for d in stream}) == 1
    assert all(d.prompt_token_ids == ref_stream[0].prompt_token_ids for d in stream)
    m = rt.metrics()
    assert m["num_driver_restarts"] == 1
    assert m["driver_recovery_s"][0] > 0 and m["driver_first_token_s"][0] >= m["driver_recovery_s"][0]
    # It serves on.
    same(rt.generate(PROMPTS[:2], GREEDY), ref_batch[:2])


def test_a_worker_and_the_driver_killed_then_the_driver_again_while_it_recovers(rt, reference):
    """A draft worker and the driver (with the target it hosts, in the actor layout) die
    together; the restarted driver is killed again while it starts its workers or resumes:
    two restarts in a row, same tokens."""
    ref_batch, ref_stream = reference

    def kills():
        (draft,) = alive("DraftActor")
        os.kill(draft["Pid"], signal.SIGKILL)
        kill_again_while_starting(rt, kill_driver(rt))

    before = rt.metrics()["num_driver_restarts"]
    batch, stream = run_all(rt, kill=kills)
    same(batch, ref_batch)
    same_stream(stream, ref_stream)
    assert rt.metrics()["num_driver_restarts"] == before + 2
    # The dead drivers' workers and placement groups went with them: one set is left.
    assert len(alive("DraftActor")) == 1 and not alive("TargetActor") and live_groups() == 1


CLIENT = """
import json, sys
from specray import SamplingParams, SpecRuntime
rt = SpecRuntime.connect(name="specray-failover", ray_address=sys.argv[1], restart_timeout_s=120)
toks, said = [], False
for d in rt.stream("def fibonacci(n):", SamplingParams(**json.loads(sys.argv[2]))):
    toks += d.token_ids
    if len(toks) >= 6 and not said:
        print("go", flush=True)
        said = True
print(json.dumps(toks), flush=True)
"""


def test_a_client_in_another_process_rides_through_a_restart(rt):
    """``SpecRuntime.connect`` from another process: its stream waits out the restart and
    ends with the tokens of the uninterrupted run (a long one, so the kill lands mid-way)."""
    params = dict(max_tokens=400, temperature=0.8, seed=11, ignore_eos=True)
    (ref,) = rt.generate(["def fibonacci(n):"], SamplingParams(**params))
    before = rt.metrics()["num_driver_restarts"]
    proc = subprocess.Popen([sys.executable, "-c", CLIENT, ray.get_runtime_context().gcs_address,
                             json.dumps(params)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "go"
        kill_driver(rt)
        toks = json.loads(proc.stdout.readline())
        assert proc.wait(timeout=120) == 0
    finally:
        proc.kill()
    assert toks == ref.token_ids
    assert rt.metrics()["num_driver_restarts"] == before + 1


def test_shutdown_after_restarts_leaves_nothing_running(rt):
    """After restarts (the tests above, or one here when this test runs alone) shutdown
    leaves no driver, worker or placement group behind."""
    if rt.metrics()["num_driver_restarts"] == 0:
        kill_driver(rt)
        rt.generate(PROMPTS[:1], GREEDY)
    assert rt.metrics()["num_driver_restarts"] >= 1
    rt.shutdown()
    deadline = time.monotonic() + 30
    while (alive("Driver") or alive("TargetActor") or alive("DraftActor") or live_groups()) \
            and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not alive("Driver") and not alive("TargetActor") and not alive("DraftActor")
    assert live_groups() == 0
