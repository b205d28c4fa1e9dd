"""``cluster.yaml``: Ray's own cluster-config validation, the specray resources on its node
types, its locks (Ray token auth, the dashboard on loopback), and real autoscaling of its
node types on one machine.

The autoscaling test derives a ``fake_multinode`` config from cluster.yaml (same node
type names, custom resources and bounds; no GPUs, one logical CPU, min_workers 0) and
starts a head with ``ray start --head --block --autoscaling-config=...`` in its own process
group, as ``ray.cluster_utils.AutoscalingCluster.start()`` would, but without its
``ray stop --force`` (which kills every Ray on the machine). The head runs with the
variables and the dashboard host of cluster.yaml's head start command and a token made by
``ray get-auth-token --generate`` where the yaml's file mount puts it, and listens on
127.0.0.1 only. The fake provider launches
each worker node (a raylet) from the head's autoscaler monitor, in the head's process
group, while Ray puts each worker process (actor) in a process group of its own within
the head's session. At the end the head's group gets SIGTERM, then every process of the
head's session or carrying the cluster's private RAY_TMPDIR gets SIGKILL by pid.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time

import pytest
import yaml
from specray_testing import ROOT, free_port, hf_greedy, ray_pids, stop_ray_head

CLUSTER_YAML = ROOT / "cluster.yaml"
CLUSTER_DOC = ROOT / "docs" / "cluster.md"
RESOURCE = {"target": "specray_target", "draft": "specray_draft"}


def load() -> dict:
    return yaml.safe_load(CLUSTER_YAML.read_text())


def worker_types(cfg: dict) -> dict:
    return {n: t for n, t in cfg["available_node_types"].items() if n != cfg["head_node_type"]}


def start_command(commands: list[str]) -> tuple[dict, list[str]]:
    """The variables a start command exports and the arguments of its ``ray start``."""
    (cmd,) = [c for c in commands if "ray start" in c]
    env, args = {}, None
    for part in cmd.split(";"):
        words = shlex.split(part)
        if words[:1] == ["export"]:
            env.update(w.split("=", 1) for w in words[1:])
        elif words[:2] == ["ray", "start"]:
            args = words[2:]
    assert args is not None, cmd
    return env, args


# -- the config as users run it ------------------------------------------------------------

def test_cluster_yaml_passes_ray_config_validation():
    from ray.autoscaler._private.util import prepare_config, validate_config

    cfg = load()
    assert cfg["provider"]["type"] == "aws" and cfg["provider"]["region"]
    # What `ray up` does before it talks to the cloud: merge the provider's defaults,
    # fill per-type bounds, then validate against Ray's JSON schema.
    prepared = prepare_config(copy.deepcopy(cfg))
    validate_config(prepared)
    for name in ("target", "draft"):
        assert prepared["available_node_types"][name]["max_workers"] == cfg["available_node_types"][name]["max_workers"]
    # setup_commands install specray on every node; head/worker commands come after.
    for key in ("head_setup_commands", "worker_setup_commands"):
        assert any("specray" in c for c in prepared[key]), key


def test_ray_validation_is_not_vacuous():
    import jsonschema
    from ray.autoscaler._private.util import prepare_config, validate_config

    bad = load()
    bad["available_node_types"]["target"]["min_wrokers"] = 1
    with pytest.raises(jsonschema.ValidationError):
        validate_config(prepare_config(bad))
    bad = load()
    bad["max_workers"] = 1      # below the sum of min_workers
    with pytest.raises(ValueError, match="min_workers"):
        validate_config(prepare_config(bad))


def test_node_types_carry_the_specray_resources_with_sane_bounds():
    cfg = load()
    types = cfg["available_node_types"]
    head = types[cfg["head_node_type"]]
    assert not any(k.startswith("specray") for k in head.get("resources", {})), "the head hosts no model worker"
    assert head.get("max_workers", 0) == 0
    assert set(worker_types(cfg)) == {"target", "draft"}
    for name, res_name in RESOURCE.items():
        t = types[name]
        assert t["resources"].get(res_name) == 1, (name, t["resources"])
        other = RESOURCE["draft" if name == "target" else "target"]
        assert other not in t["resources"]
        assert t["resources"].get("GPU") == 1
        assert t["node_config"]["InstanceType"]
        assert 0 <= t["min_workers"] <= t["max_workers"] <= cfg["max_workers"], name
    assert sum(t.get("min_workers", 0) for t in types.values()) <= cfg["max_workers"]
    assert cfg["upscaling_speed"] > 0 and cfg["idle_timeout_minutes"] > 0
    assert any("pip install" in c for c in cfg["setup_commands"])


def test_the_cluster_asks_for_the_ray_token_and_keeps_the_dashboard_on_loopback():
    """Token auth on every node, the token where the file mount puts it (never in the file
    itself), the dashboard bound to the head's loopback, and the way in documented."""
    cfg = load()
    token_at = "$HOME/.ray/auth_token"
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        env, args = start_command(cfg[key])
        assert env == {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": token_at}, (key, env)
        assert not any("0.0.0.0" in a for a in args), args
    _, head_args = start_command(cfg["head_start_ray_commands"])
    assert "--dashboard-host=127.0.0.1" in head_args
    # The file mount puts your token at the path the start commands read.
    assert cfg["file_mounts"].get(token_at.replace("$HOME", "~")) == "~/.ray/auth_token"
    # Shells of `ray exec` / `ray attach` (specray serve, clients) send it too.
    assert any("export RAY_AUTH_MODE=token" in c and ".bashrc" in c for c in cfg["setup_commands"])
    assert "RAY_AUTH_TOKEN=" not in CLUSTER_YAML.read_text()
    doc = CLUSTER_DOC.read_text()
    assert "### Security" in doc
    for needed in ("ray get-auth-token --generate", "ray dashboard cluster.yaml", "RAY_AUTH_MODE=token"):
        assert needed in doc and needed in CLUSTER_YAML.read_text(), needed


def _documented_flags(text: str) -> dict[str, dict]:
    """The JSON after every ``--draft-resources`` / ``--target-resources`` in a text (a
    shell-escaped ``\\"`` counts as ``"``); all spellings of one flag must agree."""
    found = {}
    for kind in ("draft", "target"):
        values = [json.loads(v.replace('\\"', '"')) for v in re.findall(rf"--{kind}-resources '([^']*)'", text)]
        assert values, f"--{kind}-resources is not documented"
        assert all(v == values[0] for v in values), values
        found[kind] = values[0]
    return found


@pytest.mark.parametrize("doc", [CLUSTER_YAML, CLUSTER_DOC], ids=["cluster.yaml", "docs/cluster.md"])
def test_documented_flags_place_each_worker_on_its_own_node_type(doc):
    """The flags the comments and docs tell users to pass give worker actors bundles that
    fit their node type (with the GPU a CUDA worker adds) and no other node type."""
    import argparse

    from specray.runtime.entrypoints.cli_args import add_model_args, runtime_config
    from specray.runtime.transport.actor_handle import actor_options
    from specray.runtime.transport.worker_pool import _bundle

    flags = _documented_flags(doc.read_text())
    p = argparse.ArgumentParser()
    add_model_args(p)
    args = p.parse_args(["--target", "t", "--draft", "d", "--device", "cuda",
                         "--draft-resources", json.dumps(flags["draft"]),
                         "--target-resources", json.dumps(flags["target"])])
    rc = runtime_config(args)
    cfg = load()
    types = cfg["available_node_types"]
    for kind, res in (("target", rc.cluster.target_resources), ("draft", rc.cluster.draft_resources)):
        bundle = _bundle(actor_options(res, gpu=True))
        fits = [n for n, t in types.items() if all(t.get("resources", {}).get(k, 0) >= v for k, v in bundle.items())]
        assert fits == [kind], (kind, bundle, fits)


# -- autoscaling, for real, with Ray's fake multi-node provider -----------------------------

FAKE_HEAD = "ray.head.default"        # the fake provider's head node type name is fixed
WORKER_OBJECT_STORE = 80 * 1024 * 1024


def fake_config(cfg: dict, gcs_address: str) -> dict:
    """cluster.yaml's worker node types on the fake provider: same names, custom resources
    and max_workers; min_workers 0 so nodes appear only on demand; 1 logical CPU and no
    GPU (workers run with device="cpu"). The file is read as is by the head's monitor (no
    defaults are merged for this provider), so every field is spelled out."""
    types = {FAKE_HEAD: {"resources": {"CPU": 1}, "node_config": {}, "min_workers": 0, "max_workers": 0}}
    for name, t in worker_types(cfg).items():
        res = {k: v for k, v in t["resources"].items() if k not in ("GPU", "CPU")}
        # "memory" cannot be set here: the fake provider passes what it does not pop as
        # custom resources, and Ray refuses "memory" among them.
        res.update(CPU=1, object_store_memory=WORKER_OBJECT_STORE)
        types[name] = {"resources": res, "node_config": {}, "min_workers": 0, "max_workers": t["max_workers"]}
    return {
        "cluster_name": "specray-fake",
        "max_workers": cfg["max_workers"],
        "upscaling_speed": cfg["upscaling_speed"],
        "idle_timeout_minutes": cfg["idle_timeout_minutes"],
        "docker": {},
        "provider": {
            "type": "fake_multinode",
            "use_node_id_as_ip": True,             # fake nodes share one IP; match them by node id
            "disable_node_updaters": True,         # no SSH / setup commands on fake nodes
            "disable_launch_config_check": True,
            # Required (measured: without it no node ever joins): else it assumes <node ip>:6379.
            "gcs_address": gcs_address,
        },
        "auth": {},
        "available_node_types": types,
        "head_node_type": FAKE_HEAD,
        "file_mounts": {}, "cluster_synced_files": [], "file_mounts_sync_continuously": False,
        "rsync_exclude": [], "rsync_filter": [], "initialization_commands": [], "setup_commands": [],
        "head_setup_commands": [], "worker_setup_commands": [], "head_start_ray_commands": [],
        "worker_start_ray_commands": [],
    }


def test_fake_config_is_a_valid_cluster_config():
    from ray.autoscaler._private.util import validate_config

    validate_config(fake_config(load(), "127.0.0.1:6379"))


class FakeAutoscalingHead:
    """A head with the fake autoscaler, in its own session and private temp dir, locked as
    cluster.yaml's head start command locks it."""

    def __init__(self, cfg: dict) -> None:
        self.port, self.dashboard_port = free_port(), free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.tmp = tempfile.mkdtemp(prefix="srf", dir="/tmp")   # short: unix socket paths < 107 chars
        conf = os.path.join(self.tmp, "autoscaler.yaml")
        with open(conf, "w") as f:
            json.dump(fake_config(cfg, self.address), f)
        env = dict(os.environ, RAY_FAKE_CLUSTER="1", RAY_TMPDIR=self.tmp, AUTOSCALER_UPDATE_INTERVAL_S="1",
                   # Ray resolves --node-ip-address=127.0.0.1 to the machine's network address, and
                   # its GCS and raylets then listen on every interface, unless multi-node clusters
                   # are off (as on macOS and Windows); the fake nodes are not `ray start`ed, so
                   # they come up all the same, on 127.0.0.1.
                   RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")
        for name in ("RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
            env.pop(name, None)
        # The token as users make it, in a home of its own; the yaml's file mount copies that
        # file to the nodes' homes, where its start commands read it.
        home = os.path.join(self.tmp, "home")
        os.mkdir(home)
        subprocess.run([sys.executable, "-m", "ray.scripts.scripts", "get-auth-token", "--generate"],
                       env=dict(env, HOME=home), check=True, capture_output=True, timeout=60)
        self.token = open(os.path.join(home, ".ray", "auth_token")).read().strip()
        head_env, head_args = start_command(cfg["head_start_ray_commands"])
        env.update({k: v.replace("$HOME", home) for k, v in head_env.items()})
        dashboard_host = [a for a in head_args if a.startswith("--dashboard-host=")]
        self.env = env
        self.log_path = os.path.join(self.tmp, "head.log")
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(    # this interpreter (see conftest's ray_head)
            [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block", f"--port={self.port}",
             "--node-ip-address=127.0.0.1", *dashboard_host, f"--dashboard-port={self.dashboard_port}",
             # Every port explicit (see conftest's ray_head).
             f"--ray-client-server-port={free_port()}", f"--dashboard-agent-listen-port={free_port()}",
             f"--dashboard-agent-grpc-port={free_port()}", f"--runtime-env-agent-port={free_port()}",
             f"--metrics-export-port={free_port()}", "--num-cpus=1", f"--temp-dir={self.tmp}",
             "--object-store-memory=100000000", "--disable-usage-stats", f"--autoscaling-config={conf}"],
            env=env, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_started(self, timeout: float = 60) -> None:
        deadline = time.time() + timeout
        while "Ray runtime started." not in open(self.log_path).read():
            if self.proc.poll() is not None or time.time() > deadline:
                raise RuntimeError("fake autoscaling head did not start:\n" + self.tail())
            time.sleep(0.5)

    def tail(self, n: int = 4000) -> str:
        out = open(self.log_path).read()[-n:]
        monitor = os.path.join(self.tmp, "session_latest", "logs", "monitor.log")
        if os.path.exists(monitor):
            out += "\n--- monitor.log ---\n" + open(monitor).read()[-n:]
        return out

    def stop(self, keep_logs: bool) -> None:
        self.leftovers = stop_ray_head(self.proc, self.tmp)
        self._log.close()
        if not keep_logs:
            shutil.rmtree(self.tmp, ignore_errors=True)


def listening_addresses(pids: list[int]) -> set[str]:
    """Every address a TCP socket held by one of ``pids`` listens on (from /proc)."""
    import ipaddress

    inodes = set()
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue                        # gone meanwhile
        for fd in fds:
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:["):
                inodes.add(link[len("socket:["):-1])
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for row in open(table).read().splitlines()[1:]:
            f = row.split()
            if f[3] != "0A" or f[9] not in inodes:      # 0A: LISTEN
                continue
            raw = bytes.fromhex(f[1].split(":")[0])      # 32-bit words, each in host (little-endian) order
            ip = ipaddress.ip_address(b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4)))
            found.add(str(getattr(ip, "ipv4_mapped", None) or ip))
    return found


CLIENT = """
import json, sys, time
import ray
from ray._private.state import actors
from specray import RuntimeConfig, SamplingParams, SpecRuntime

target, draft, address, prompts = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
t0 = time.time()
rt = SpecRuntime(RuntimeConfig(target=target, draft=draft, num_speculative_tokens=3, block_size=4,
                               device="cpu", dtype="float32", draft_resources={"specray_draft": 1},
                               target_resources={"specray_target": 1}, ray_address=address,
                               placement_timeout_s=90))
ready_s = time.time() - t0
outs = rt.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0))
nodes = [{"node_id": n["NodeID"], "resources": n["Resources"]} for n in ray.nodes() if n["Alive"]]
acts = [{"class_name": a["ActorClassName"], "node_id": a["Address"]["NodeID"]}
        for a in actors().values() if a["State"] == "ALIVE"]
metrics = rt.metrics()
rt.shutdown()
print(json.dumps({"tokens": [o.token_ids for o in outs], "nodes": nodes, "actors": acts, "ready_s": ready_s,
                  "num_draft_tokens": metrics["num_draft_tokens"]}))
"""


@pytest.mark.slow
def test_autoscaler_launches_target_and_draft_nodes_for_the_workers(llama_pair):
    cfg = load()
    t, d = llama_pair
    prompts = [[1, 2, 3, 4], [9, 8, 7], [5, 6, 7, 8, 9]]
    head = FakeAutoscalingHead(cfg)
    ok = False
    try:
        head.wait_started()
        # A separate client process: this test process's own Ray state stays untouched.
        env = dict(head.env)
        env.pop("RAY_FAKE_CLUSTER", None)
        c = subprocess.run([sys.executable, "-c", CLIENT, t, d, head.address, json.dumps(prompts)], cwd=ROOT,
                           env=env, capture_output=True, text=True, timeout=180)
        assert c.returncode == 0, c.stderr[-3000:] + "\n" + head.tail()
        got = json.loads(c.stdout.strip().splitlines()[-1])

        assert got["tokens"] == hf_greedy(t, prompts, 12)
        assert got["num_draft_tokens"] > 0

        # Locked as cluster.yaml locks it: the dashboard's Jobs API wants the token ...
        import urllib.error
        import urllib.request

        jobs = f"http://127.0.0.1:{head.dashboard_port}/api/jobs/"
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(jobs, timeout=30)
        assert refused.value.code == 401
        bearer = urllib.request.Request(jobs, headers={"Authorization": f"Bearer {head.token}"})
        with urllib.request.urlopen(bearer, timeout=30) as r:
            assert r.status == 200
        # ... so does the GCS ...
        wrong = subprocess.run([sys.executable, "-c", "import ray; ray.init()"], cwd=ROOT, capture_output=True,
                               text=True, timeout=120, env=dict(env, RAY_ADDRESS=head.address, RAY_AUTH_TOKEN="0" * 32))
        assert wrong.returncode != 0 and "InvalidAuthToken" in wrong.stderr, wrong.stderr[-3000:]
        # ... and every server of the cluster, the autoscaled nodes' included, is on loopback.
        addresses = listening_addresses(ray_pids(head.proc.pid, head.tmp))
        assert addresses and addresses <= {"127.0.0.1", "::1"}, addresses

        nodes = {n["node_id"]: n["resources"] for n in got["nodes"]}
        kinds = {nid: [k for k, r in RESOURCE.items() if r in res] for nid, res in nodes.items()}
        # The head has no specray resource; every other node was launched by the
        # autoscaler from one of cluster.yaml's worker node types.
        assert sorted(len(v) for v in kinds.values()) == [0] + [1] * (len(nodes) - 1), nodes
        assert {k for v in kinds.values() for k in v} == {"target", "draft"}, nodes
        # Those nodes came up within each type's bounds.
        for kind in RESOURCE:
            assert 1 <= sum(v == [kind] for v in kinds.values()) <= cfg["available_node_types"][kind]["max_workers"]

        placed = {}
        for a in got["actors"]:
            placed.setdefault(a["class_name"], []).append(a["node_id"])
        # The actor layout: the driver's actor hosts the target worker and asks for its
        # resources, so the autoscaler launched a target node for it.
        assert "TargetActor" not in placed, got["actors"]
        assert len(placed.get("Driver", [])) == 1 and len(placed.get("DraftActor", [])) == 1, got["actors"]
        assert kinds[placed["Driver"][0]] == ["target"]
        assert kinds[placed["DraftActor"][0]] == ["draft"]
        ok = True
    finally:
        head.stop(keep_logs=not ok)
    assert not head.leftovers, f"processes of the fake cluster survived: {head.leftovers}"
