"""Shared fixtures: tiny models saved with save_pretrained, a private local Ray, and a real
head node. Helpers live in specray_testing.py (test modules import them from there)."""

from __future__ import annotations

import os
import sys
import tempfile

import pytest
from specray_testing import free_port, make_pair, make_plan, stop_ray_head

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_xdist_make_scheduler(config, log):
    """Under ``--dist loadscope`` (``scripts/test``), every module that uses ``ray_head``
    runs on one worker: a head node with its dashboard is started once, not once a worker."""
    if config.getoption("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    uses_head: dict[str, bool] = {}

    class OneHeadNode(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            if module not in uses_head:
                path = os.path.join(str(config.rootpath), module)
                with open(path) as f:
                    uses_head[module] = "ray_head" in f.read()
            return "ray_head" if uses_head[module] else super()._split_scope(nodeid)

    return OneHeadNode(config, log)


@pytest.fixture(scope="session")
def plan_builder():
    """A StepPlan the way the driver fills it (``specray_testing.make_plan``)."""
    return make_plan


@pytest.fixture(scope="session")
def llama_pair(tmp_path_factory):
    return make_pair(tmp_path_factory.mktemp("llama"), "llama")


@pytest.fixture(scope="session")
def qwen2_pair(tmp_path_factory):
    return make_pair(tmp_path_factory.mktemp("qwen2"), "qwen2", kv_heads=1, seed=1)


_RAY_TMP = tempfile.mkdtemp(prefix="srt", dir="/tmp")
os.environ["RAY_TMPDIR"] = _RAY_TMP


def _local_ray():
    """A private local Ray, started once and reused by every test that needs one (starting
    one takes 8-15 s here). Tests that need a multi-node cluster shut it down; the next
    user starts it again, so those tests sit together in one module."""
    import ray

    if not ray.is_initialized():
        ray.init(address="local", num_cpus=2, object_store_memory=150 * 1024 * 1024, include_dashboard=False,
                 log_to_driver=False, _temp_dir=_RAY_TMP)
    return ray


@pytest.fixture
def ray_session():
    return _local_ray()


@pytest.fixture(scope="module")
def ray_module():
    return _local_ray()


@pytest.fixture(scope="session")
def ray_head():
    """A real head node started with ``ray start --head --block`` (dashboard and job server
    included), as users run one, listening on 127.0.0.1 only. Stopped by its pid at the
    end: never ``ray stop``, which would kill every Ray on the machine. Yields (gcs address,
    dashboard url, env for clients)."""
    import subprocess
    import time
    import urllib.request

    port, dash = free_port(), free_port()
    tmp = tempfile.mkdtemp(prefix="srh", dir="/tmp")
    # Without token auth (the tests' own processes call its dashboard), so on loopback only:
    # Ray resolves --node-ip-address=127.0.0.1 to the machine's network address, and its GCS
    # and raylet then listen on every interface, unless multi-node clusters are off (as on
    # macOS and Windows). Its clients inherit the setting, and with it 127.0.0.1 as their
    # node address.
    env = dict(os.environ, RAY_AUTH_MODE="disabled", RAY_TMPDIR=tmp, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")
    env.pop("RAY_ADDRESS", None)
    # Jobs run their entrypoint with the head's PATH: `specray` must be found there.
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    log = open(os.path.join(tmp, "head.log"), "w")
    proc = subprocess.Popen(
        # This interpreter, not the `ray` script's shebang (a venv copied from another
        # checkout names that checkout's python, whose workers import its specray).
        [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block", f"--port={port}",
         "--node-ip-address=127.0.0.1",
         # Every port explicit: the default agent ports (52365, ...) are taken by any other
         # Ray on this machine, including this session's private one, and a head whose
         # agent cannot bind accepts no jobs.
         f"--ray-client-server-port={free_port()}", f"--dashboard-agent-listen-port={free_port()}",
         f"--dashboard-agent-grpc-port={free_port()}", f"--runtime-env-agent-port={free_port()}",
         f"--metrics-export-port={free_port()}",
         f"--dashboard-port={dash}", "--include-dashboard=true", "--dashboard-host=127.0.0.1", "--num-cpus=2",
         f"--temp-dir={tmp}", "--object-store-memory=150000000", "--disable-usage-stats"],
        env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{dash}"
    deadline = time.time() + 120
    while True:
        # Ready when the job server takes a job: the dashboard answers before its agent
        # registers ("No available agent to submit job").
        try:
            urllib.request.urlopen(url + "/api/version", timeout=2)
            from ray.job_submission import JobSubmissionClient

            JobSubmissionClient(url).submit_job(entrypoint="true")
            break
        except Exception:
            if proc.poll() is not None or time.time() > deadline:
                stop_ray_head(proc, tmp)
                raise RuntimeError(f"ray head did not start; see {log.name}") from None
            time.sleep(1)
    client_env = dict(env, RAY_ADDRESS=f"127.0.0.1:{port}")
    yield f"127.0.0.1:{port}", url, client_env
    stop_ray_head(proc, tmp)
    log.close()
