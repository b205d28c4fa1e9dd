"""`specray serve` in one process, `SpecRuntime.connect` from another, against a real
head started by the test."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from specray_testing import ROOT, hf_greedy

CLIENT = """
import json, sys
from specray import SpecRuntime, SamplingParams
runs = []
for _ in range(int(sys.argv[3]) if len(sys.argv) > 3 else 1):
    rt = SpecRuntime.connect(name=sys.argv[1], namespace="specray-test", ray_address=sys.argv[2])
    outs = rt.generate([[1, 2, 3, 4], [9, 8, 7]], SamplingParams(max_tokens=12, temperature=0.0))
    streamed = [d.token_ids for d in rt.stream([5, 6, 7], SamplingParams(max_tokens=6, temperature=0.0))]
    runs.append({"tokens": [o.token_ids for o in outs], "streamed": streamed, "metrics": rt.metrics()})
    rt.shutdown()   # an attached handle detaches: the driver keeps serving the next one
print(json.dumps(runs))
"""


def cli(args, env, timeout=180):
    return subprocess.run([sys.executable, "-m", "specray.runtime.entrypoints.cli",
                           *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_serve_then_connect_from_another_process(ray_head, llama_pair):
    address, _, env = ray_head
    t, d = llama_pair
    start = cli(["serve", "--target", t, "--draft", d, "-k", "3", "--block-size", "4", "--device", "cpu",
                 "--dtype", "float32", "--name", "srv", "--namespace", "specray-test", "--ray-address", address], env)
    assert start.returncode == 0, start.stderr[-3000:]
    assert "attach with SpecRuntime.connect" in start.stdout
    try:
        again = cli(["serve", "--target", t, "--proposer", "ngram", "--name", "srv", "--namespace", "specray-test",
                     "--ray-address", address], env)
        assert again.returncode == 1 and "already running" in again.stderr
        # Two handles one after the other: a detached client leaves the driver serving.
        c = subprocess.run([sys.executable, "-c", CLIENT, "srv", address, "2"], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=180)
        assert c.returncode == 0, c.stderr[-3000:]
        runs = json.loads(c.stdout.strip().splitlines()[-1])
        assert len(runs) == 2
        expected, expected_stream = hf_greedy(t, [[1, 2, 3, 4], [9, 8, 7]], 12), hf_greedy(t, [[5, 6, 7]], 6)[0]
        for got in runs:
            assert got["tokens"] == expected
            assert sum(got["streamed"], []) == expected_stream
            assert got["metrics"]["num_draft_tokens"] > 0
    finally:
        stop = cli(["serve", "--stop", "--name", "srv", "--namespace", "specray-test", "--ray-address", address], env)
    assert stop.returncode == 0, stop.stderr[-3000:]
    missing = subprocess.run([sys.executable, "-c", CLIENT, "srv", address], cwd=ROOT, env=env,
                             capture_output=True, text=True, timeout=120)
    assert missing.returncode != 0 and "no specray driver named 'srv'" in missing.stderr


def test_serve_http_in_the_foreground_until_sigterm_then_nothing_left():
    """``specray serve --http`` with no cluster: its own local Ray, the endpoint answering
    once it prints where; SIGTERM stops ingress, driver, workers and that Ray."""
    import pathlib
    import signal
    import tempfile
    import time
    import urllib.request

    from specray_testing import free_port

    # Short: Ray's socket paths under it must stay within AF_UNIX's 107 bytes.
    tmp_path = pathlib.Path(tempfile.mkdtemp(prefix="srs", dir="/tmp"))
    port = free_port()
    env = dict(os.environ, RAY_TMPDIR=str(tmp_path), SPECRAY_OBJECT_STORE_BYTES=str(100 * 1024 * 1024))
    env.pop("RAY_ADDRESS", None)
    log = open(tmp_path / "serve.log", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "specray.runtime.entrypoints.cli",
                             "serve", "--http", "--port", str(port),
                             "--served-model-name", "tiny", "--device", "cpu"], cwd=ROOT, env=env,
                            stdout=log, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 150
        while "specray: serving" not in (tmp_path / "serve.log").read_text():
            assert proc.poll() is None and time.time() < deadline, (tmp_path / "serve.log").read_text()[-3000:]
            time.sleep(0.5)
        assert f"http://127.0.0.1:{port}/v1" in (tmp_path / "serve.log").read_text()
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", method="POST",
                                     data=json.dumps({"model": "tiny", "prompt": "import", "max_tokens": 5}).encode(),
                                     headers={"content-type": "application/json"})
        body = json.loads(urllib.request.urlopen(req, timeout=60).read())
        assert body["usage"]["completion_tokens"] >= 1
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=90) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    out = (tmp_path / "serve.log").read_text()
    assert "specray: stopped" in out
    # Every Ray process it started ran under its own RAY_TMPDIR; none is left.
    left = subprocess.run(["pgrep", "-f", str(tmp_path)], capture_output=True, text=True).stdout.split()
    assert left == [], left
