"""`specray batch`: a JSONL file in, one output line per good input line out, malformed
lines reported by number; as a subprocess with its own Ray, and as a real `ray job submit`
to a head started by the test."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from specray_testing import ROOT, hf_greedy

from specray.runtime.entrypoints.batch.files import Location, check_output_place
from specray.runtime.entrypoints.batch.job import (
    Item,
    Output,
    _Refused,
    add_parser,
    generate_all,
    generate_chunk,
    output_record,
    parse_line,
    read_input,
    run,
)
from specray.runtime.entrypoints.batch.job import main as batch_main
from specray.runtime.entrypoints.cli_args import runtime_config
from specray.runtime.request_output import RequestOutput, TokenLogprob
from specray.scheduler.sampling_params import SamplingParams

MODEL_FLAGS = ["-k", "3", "--block-size", "4", "--device", "cpu", "--dtype", "float32", "--max-model-len", "64",
               "--no-progress", "--temperature", "0"]

# (line text, the reason's key words or None for a good line); blank lines are skipped
LINES = [
    ('{"prompt": [1, 2, 3, 4], "id": "first"}', None),
    ("", None),
    ('{"prompt": [5, 6, 7], "max_tokens": 5, "temperature": 0.9, "top_k": 20, "seed": 11}', None),
    ('{"prompt": [1, 2, 3', "bad JSON"),
    ("[1, 2, 3]", "expected a JSON object"),
    ('{"prompt": [4, 5], "colour": "red"}', 'unknown field(s) "colour"'),
    ('{"prompt": [4, 5], "max_tokens": 0}', "max_tokens must be >= 1"),
    ("   ", None),
    ('{"prompt": [3, 97, 4]}', "token id 97 is outside the vocabulary"),
    ('{"prompt": "def f(x):\u2028 return x"}', "no tokenizer"),   # U+2028 splits no line
    ('{"max_tokens": 3}', 'missing "prompt" (or "messages")'),
    ('{"prompt": [9, 8, 7, 6, 5], "id": 7, "max_tokens": 9}', None),
    ('{"prompt": [2, 4, 6], "stop_token_ids": [41]}', None),   # greedy: 30, 19, 22, 41, ...
]
BAD = {i + 1: why for i, (text, why) in enumerate(LINES) if why}
GOOD = [i + 1 for i, (text, why) in enumerate(LINES) if text.strip() and not why]


def write_input(path) -> str:
    path.write_text("".join(text + "\n" for text, _ in LINES), encoding="utf-8")
    return str(path)


def local_env() -> dict:
    env = dict(os.environ, RAY_TMPDIR=tempfile.mkdtemp(prefix="srb", dir="/tmp"))
    env.pop("RAY_ADDRESS", None)
    return env


def check_outputs(records: list[dict], target: str, max_tokens: int) -> None:
    assert [r["line"] for r in records] == GOOD
    by_line = {r["line"]: r for r in records}
    greedy = [n for n in GOOD if n != 3]
    specs = {n: json.loads(LINES[n - 1][0]) for n in GOOD}
    for n in GOOD:
        r, spec = by_line[n], specs[n]
        assert r["prompt_token_ids"] == spec["prompt"]
        assert r.get("id", "absent") == spec.get("id", "absent")
        assert r["text"] == ""                      # no tokenizer
        assert r["num_accepted_tokens"] <= r["num_draft_tokens"]
    assert len(by_line[3]["token_ids"]) == 5 and by_line[3]["finish_reason"] == "length"
    assert all(0 <= t < 97 for t in by_line[3]["token_ids"])
    for n in greedy:
        spec, r = specs[n], by_line[n]
        want = hf_greedy(target, [spec["prompt"]], spec.get("max_tokens", max_tokens))[0]
        stops = [i for i, tok in enumerate(want) if tok in spec.get("stop_token_ids", [])]
        if stops:
            want = want[:stops[0] + 1]
        assert r["token_ids"] == want
        assert r["finish_reason"] == ("stop" if stops else "length")
    assert by_line[13]["finish_reason"] == "stop" and by_line[13]["token_ids"][-1] == 41
    assert len(by_line[12]["token_ids"]) == 9 and len(by_line[1]["token_ids"]) == max_tokens


def reported(stderr: str) -> dict[int, str]:
    out = {}
    for ln in stderr.splitlines():
        if ln.startswith("line ") and ": " in ln:
            num, reason = ln[5:].split(": ", 1)
            out[int(num)] = reason
    return out


def test_batch_skips_or_fails_on_malformed_lines(llama_pair, tmp_path, ray_session, capsys):
    t, d = llama_pair
    inp = write_input(tmp_path / "in.jsonl")
    flags = ["--target", t, "--draft", d, *MODEL_FLAGS, "--input", inp, "--max-tokens", "8"]
    skip_out, fail_out = tmp_path / "out.jsonl", tmp_path / "fail.jsonl"
    # `--on-error skip` as users run it: a subprocess with its own private Ray ...
    proc = subprocess.Popen([sys.executable, "-m", "specray.runtime.entrypoints.batch.job",
                             *flags, "--output", str(skip_out)], cwd=ROOT,
                            env=local_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    # ... and meanwhile `--on-error fail` in this process, on the tests' shared Ray.
    assert batch_main(flags + ["--output", str(fail_out), "--on-error", "fail"]) == 2
    fe = capsys.readouterr().err
    assert sorted(reported(fe)) == sorted(BAD), fe[-3000:]
    assert "nothing generated" in fe
    so, se = proc.communicate(timeout=240)

    assert proc.returncode == 0, se[-3000:]
    got = reported(se)
    assert sorted(got) == sorted(BAD), se[-3000:]
    for n, why in BAD.items():
        assert why in got[n], (n, got[n])
    records = [json.loads(ln) for ln in skip_out.read_text().splitlines()]
    check_outputs(records, t, 8)
    summary = se.strip().splitlines()[-1]
    assert f"{len(GOOD)} done, {len(BAD)} skipped" in summary and "acceptance_rate=" in summary
    assert so == ""
    assert {p.name for p in tmp_path.iterdir()} == {"in.jsonl", "out.jsonl"}   # no fail.jsonl, no temp file


def test_batch_as_a_ray_job(ray_head, llama_pair, tmp_path):
    """Through a real head's job server: the output lands where --output says (a file://
    URI here) and the job says where; a relative --output, which would land in the job's
    temporary copy of the working directory, is refused before anything starts."""
    from ray.job_submission import JobStatus, JobSubmissionClient

    _, url, env = ray_head
    t, d = llama_pair
    inp, out = write_input(tmp_path / "in.jsonl"), tmp_path / "out.jsonl"
    ray_cli = os.path.join(os.path.dirname(sys.executable), "ray")

    def submit(job_id: str, output: str):
        entry = ["specray", "batch", "--target", t, "--draft", d, *MODEL_FLAGS, "--input", inp, "--output", output,
                 "--max-tokens", "8"]
        return subprocess.run([ray_cli, "job", "submit", "--address", url, "--submission-id", job_id,
                               "--working-dir", str(ROOT), "--", *entry],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)

    refused = submit(f"specray-batch-rel-{os.getpid()}", "out.jsonl")
    logs = refused.stdout + refused.stderr
    assert refused.returncode != 0, logs[-4000:]
    assert "--output out.jsonl is a relative path, and this runs inside a Ray job" in logs, logs[-4000:]
    assert "runtime_resources" in logs and "Started a local Ray" not in logs

    job_id = f"specray-batch-{os.getpid()}"
    p = submit(job_id, out.as_uri())
    logs = p.stdout + p.stderr
    assert p.returncode == 0, logs[-4000:]
    assert JobSubmissionClient(url).get_job_status(job_id) == JobStatus.SUCCEEDED
    assert f"{len(GOOD)} done, {len(BAD)} skipped" in logs
    assert f"wrote {len(GOOD)} line(s) to {out} on " in logs and "(the Ray head, inside a job)" in logs
    assert sorted(reported(logs)) == sorted(BAD), logs[-4000:]
    check_outputs([json.loads(ln) for ln in out.read_text().splitlines()], t, 8)


def test_a_relative_output_is_refused_only_inside_a_jobs_working_dir(tmp_path, monkeypatch):
    wd = tmp_path / "session_x" / "runtime_resources" / "working_dir_files" / "_ray_pkg_1"
    wd.mkdir(parents=True)
    monkeypatch.chdir(wd)
    check_output_place("out.jsonl")                 # not in a job: the user's own directory
    monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", json.dumps({"runtime_env": {"working_dir": "gcs://x.zip"}}))
    with pytest.raises(ValueError, match=r"--output out.jsonl is a relative path.*absolute path, a file://"):
        check_output_place("out.jsonl")
    for ok in (str(tmp_path / "out.jsonl"), "file:///tmp/out.jsonl", "s3://bucket/out.jsonl", "-"):
        check_output_place(ok)
    # A job started without --working-dir runs where its head put it: not refused there.
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", json.dumps({"runtime_env": {}}))
    check_output_place("out.jsonl")


def test_batch_reads_and_writes_uris(llama_pair, tmp_path, ray_session, capsys):
    t, d = llama_pair
    inp = write_input(tmp_path / "in.jsonl")
    out = tmp_path / "sub dir" / "out.jsonl"
    out.parent.mkdir()
    flags = ["--target", t, "--draft", d, *MODEL_FLAGS, "--colocate", "--max-tokens", "8"]
    assert batch_main(flags + ["--input", Path(inp).as_uri(), "--output", out.as_uri()]) == 0
    err = capsys.readouterr().err
    assert f"wrote {len(GOOD)} line(s) to {out} on " in err
    check_outputs([json.loads(ln) for ln in out.read_text().splitlines()], t, 8)
    # An absolute path, and a URI pyarrow cannot open: named, nothing started.
    absolute = tmp_path / "abs.jsonl"
    assert batch_main(flags + ["--input", inp, "--output", str(absolute)]) == 0
    assert absolute.read_text() == out.read_text()
    assert batch_main(flags + ["--input", "nosuchfs://bucket/in.jsonl", "--output", "-"]) == 2
    assert "--input nosuchfs://bucket/in.jsonl" in capsys.readouterr().err


def test_output_to_another_filesystem_appears_whole_at_commit(tmp_path):
    """A filesystem that is not the local one (a SubTree over a directory stands in for
    HDFS and friends): spooled locally, then moved into place whole."""
    from pyarrow import fs

    sub = fs.SubTreeFileSystem(str(tmp_path / "remote"), fs.LocalFileSystem())
    (tmp_path / "remote").mkdir()
    loc = Location("sub://out/o.jsonl", sub, "out/o.jsonl")
    out = Output(loc.spec, loc)
    out.write({"line": 1})
    out.write({"line": 2})
    assert not (tmp_path / "remote" / "out").exists()
    out.commit()
    assert (tmp_path / "remote" / "out" / "o.jsonl").read_text() == '{"line": 1}\n{"line": 2}\n'
    assert [p.name for p in (tmp_path / "remote" / "out").iterdir()] == ["o.jsonl"]
    half = Output(loc.spec, Location(loc.spec, sub, "out/half.jsonl"))
    half.write({"line": 3})
    half.discard()
    assert not (tmp_path / "remote" / "out" / "half.jsonl").exists()


class FakeRuntime:
    """Admits a call whole or refuses it naming its first bad request, like the driver."""

    def __init__(self):
        self.calls = 0

    def generate(self, prompts, params):
        self.calls += 1
        time.sleep(0.01 * (8 - prompts[0][0] % 8))     # later chunks finish first
        for i, p in enumerate(prompts):
            if 99 in p:
                raise ValueError(f"request {i}: prompt token id 99 is outside the vocabulary [0, 97)")
        return [RequestOutput(str(i), p, [1], "", "length") for i, p in enumerate(prompts)]


def test_generate_chunk_drops_each_refused_line_and_resubmits_the_rest():
    items = [Item(n, p, SamplingParams()) for n, p in enumerate([[1], [99], [2], [99, 1], [3]], start=1)]
    rejected = []
    rt = FakeRuntime()
    done = generate_chunk(rt, items, lambda line, why: rejected.append((line, why)))
    assert [it.line for it, _ in done] == [1, 3, 5]
    assert [o.prompt_token_ids for _, o in done] == [[1], [2], [3]]
    assert rejected == [(2, "prompt token id 99 is outside the vocabulary [0, 97)"),
                        (4, "prompt token id 99 is outside the vocabulary [0, 97)")]
    assert rt.calls == 3
    assert generate_chunk(rt, [Item(1, [99], SamplingParams())], lambda *a: None) == []


def test_generate_chunk_waits_while_the_driver_is_overloaded():
    from specray import Overloaded

    class Busy(FakeRuntime):
        def generate(self, prompts, params):
            if self.calls < 2:
                self.calls += 1
                raise Overloaded("overloaded: 4096 requests pending, max_pending is 4096")
            return super().generate(prompts, params)

    rt = Busy()
    done = generate_chunk(rt, [Item(1, [1], SamplingParams()), Item(2, [2], SamplingParams())], lambda *a: None)
    assert [it.line for it, _ in done] == [1, 2] and rt.calls == 3     # refused twice, not dropped


def test_generate_all_writes_in_input_order_while_chunks_overlap(tmp_path):
    items = [Item(n, [n] if n % 5 else [99], SamplingParams()) for n in range(1, 15)]
    out = Output(str(tmp_path / "out.jsonl"))
    rejected = []
    done, tokens = generate_all(FakeRuntime(), items, out, lambda line, why: rejected.append(line), chunk_size=3,
                                in_flight=3, progress=False)
    out.commit()
    lines = [json.loads(ln)["line"] for ln in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert lines == [n for n in range(1, 15) if n % 5] and (done, tokens) == (len(lines), len(lines))
    assert sorted(rejected) == [5, 10]

    def refuse(line, why):
        raise _Refused
    with pytest.raises(_Refused):
        generate_all(FakeRuntime(), items, Output("-"), refuse, chunk_size=3, in_flight=2, progress=False)


@pytest.mark.parametrize("text, why", [
    ('{"prompt": []}', "prompt is empty"),
    ('{"prompt": ""}', "prompt is empty"),
    ('{"prompt": [1, 2.0]}', "token ids must be ints, got number"),
    ('{"prompt": [1, true]}', "token ids must be ints, got boolean"),
    ('{"prompt": {"a": 1}}', "must be a string or a list of token ids, got object"),
    ('{"prompt": [1], "temperature": -1}', "temperature"),
    ('{"prompt": [1], "top_p": 0}', "top_p"),
    ('{"prompt": [1], "stop_token_ids": 3}', "stop_token_ids"),
    ('{"prompt": [1], "logprobs": 21}', "logprobs"),
    ('{"prompt": [1], "logprobs": "3"}', "logprobs"),
    ('{"prompt": [1], "speculation": "yes"}', "speculation"),
    ('"just a string"', "expected a JSON object, got string"),
])
def test_parse_line_names_what_is_wrong(text, why):
    with pytest.raises(ValueError, match=why.replace("(", r"\(")):
        parse_line(text, 1, {})


def test_parse_line_merges_defaults_with_the_line():
    item = parse_line('{"prompt": "a\u2028b", "top_k": 5, "id": null}', 3,
                      dict(max_tokens=7, temperature=0.5, top_k=0))
    assert item.prompt == "a\u2028b" and item.id is None and item.line == 3
    assert (item.params.max_tokens, item.params.temperature, item.params.top_k) == (7, 0.5, 5)


def test_lines_may_ask_for_logprobs_and_plain_decoding_and_the_output_carries_them():
    item = parse_line('{"prompt": [1, 2], "logprobs": 2, "speculation": false}', 1, {})
    assert (item.params.logprobs, item.params.speculation) == (2, False)
    plain = output_record(Item(1, [1], SamplingParams()), RequestOutput("1", [1], [4], "", "length"))
    assert "logprobs" not in plain
    out = RequestOutput("2", [1], [4, 5], "", "length",
                        logprobs=[TokenLogprob(4, -0.25, [(4, -0.25), (9, -2.0)]), TokenLogprob(5, -1.5, [])])
    rec = json.loads(json.dumps(output_record(item, out)))
    assert rec["logprobs"] == [{"token_id": 4, "logprob": -0.25, "top": [[4, -0.25], [9, -2.0]]},
                               {"token_id": 5, "logprob": -1.5, "top": []}]


def test_read_input_numbers_physical_lines(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_bytes(b'{"prompt": [1]}\n\n\xff\xfe\n{"prompt": "a\xe2\x80\xa8b"}\n{"prompt": [2]}')
    items, errors = read_input(str(path), {})
    assert [(it.line, it.prompt) for it in items] == [(1, [1]), (4, "a\u2028b"), (5, [2])]
    assert errors == [(3, "not valid UTF-8 at byte 0")]


def test_output_file_appears_whole_or_not_at_all(tmp_path, capsys):
    path = tmp_path / "out.jsonl"
    out = Output(str(path))
    out.write({"line": 1})
    assert not path.exists() and len(list(tmp_path.iterdir())) == 1
    out.commit()
    out.discard()                               # after commit: nothing to do
    assert path.read_text() == '{"line": 1}\n' and list(tmp_path.iterdir()) == [path]
    umask = int(next(ln for ln in open("/proc/self/status") if ln.startswith("Umask:")).split()[1], 8)
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask
    half = Output(str(tmp_path / "other.jsonl"))
    half.write({"line": 2})
    half.discard()
    assert list(tmp_path.iterdir()) == [path]
    std = Output("-")
    std.write({"line": 3})
    std.commit()
    assert capsys.readouterr().out == '{"line": 3}\n'


def test_add_parser_registers_the_subcommand():
    parser = argparse.ArgumentParser(prog="specray")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["batch", "--input", "in.jsonl", "--output", "-", "--temperature", "0.7",
                              "--stop-token-ids", "3,5", "--on-error", "fail", "-k", "2"])
    assert args.func is run
    assert (args.temperature, args.stop_token_ids, args.on_error) == (0.7, [3, 5], "fail")
    assert args.num_speculative_tokens == 2
    assert (args.max_tokens, args.chunk_size, args.target) == (128, 64, None)


def test_a_batch_job_killed_and_run_again_resumes_from_its_checkpoint(llama_pair, tmp_path, ray_session, capsys):
    """SIGKILL of the `specray batch` process (its driver goes with it) once some chunks
    are done; the same command again generates only the rest, and the output equals an
    uninterrupted run's: nothing missing, nothing twice, written whole."""
    import signal

    import ray

    t, d = llama_pair
    lines = [json.dumps({"prompt": [1 + i, 2 + i, 3], "max_tokens": 40, "ignore_eos": True,
                         **({"temperature": 0.9, "seed": i} if i % 2 else {})}) for i in range(16)]
    inp = tmp_path / "in.jsonl"
    inp.write_text("\n".join(lines) + "\n")
    flags = ["--target", t, "--draft", d, *MODEL_FLAGS, "--input", str(inp), "--chunk-size", "2",
             "--chunks-in-flight", "1"]
    ref = tmp_path / "ref.jsonl"
    assert batch_main(flags + ["--output", str(ref)]) == 0
    out = tmp_path / "out.jsonl"
    partial = tmp_path / ".out.jsonl.specray-partial"
    env = dict(os.environ, RAY_ADDRESS=ray.get_runtime_context().gcs_address)
    proc = subprocess.Popen([sys.executable, "-m", "specray.runtime.entrypoints.batch.job",
                             *flags, "--output", str(out)], cwd=ROOT,
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while proc.poll() is None and time.monotonic() < deadline:
        if partial.exists() and len(partial.read_text().splitlines()) >= 3:     # the header and a chunk
            proc.send_signal(signal.SIGKILL)
            break
        time.sleep(0.005)
    assert proc.wait(timeout=60) == -signal.SIGKILL, proc.stderr.read()
    assert not out.exists()
    done_before = len(partial.read_text().splitlines()) - 1
    assert 2 <= done_before < 16
    capsys.readouterr()
    assert batch_main(flags + ["--output", str(out)]) == 0
    assert f"resuming: {done_before} line(s) done" in capsys.readouterr().err
    assert out.read_text() == ref.read_text()
    assert not partial.exists()


MODEL = {"target": "/models/t", "draft": "/models/d", "proposer": "draft", "num_speculative_tokens": 3,
         "device": "cpu", "dtype": "float32", "max_model_len": 64}


def record(line: int, prompt: list[int], tokens: list[int], **extra) -> dict:
    """What output_record writes for a finished line."""
    return {"line": line, **extra, "prompt_token_ids": prompt, "token_ids": tokens, "text": "",
            "finish_reason": "length", "num_draft_tokens": 0, "num_accepted_tokens": 0}


def test_a_checkpoint_keeps_whole_records_of_the_same_input_only(tmp_path):
    from specray.runtime.entrypoints.batch.checkpoint import Checkpoint, checkpoint_path

    out = tmp_path / "out.jsonl"
    path = checkpoint_path(Location(str(out), None, str(out)))
    assert path == str(tmp_path / ".out.jsonl.specray-partial")
    assert checkpoint_path(None) is None
    items = [Item(i, [i], SamplingParams(max_tokens=3)) for i in (1, 2, 3)]
    first = Checkpoint(path, items, MODEL)
    first.add([record(1, [1], [5]), record(2, [2], [6])])
    first.close()
    with open(path, "a") as f:
        f.write('{"line": 3, "tok')                 # the record a kill cut off
    again = Checkpoint(path, items, MODEL)
    assert sorted(again.records) == [1, 2] and again.ignored == [] and again.started_over is None
    again.add([record(3, [3], [7])])
    again.close()
    assert sorted(Checkpoint(path, items, MODEL).records) == [1, 2, 3]
    assert os.stat(path).st_mode & 0o777 == 0o600
    # Another input (a changed line) is another job: its checkpoint starts empty.
    other = [Item(i, [i], SamplingParams(max_tokens=4)) for i in (1, 2, 3)]
    fresh = Checkpoint(path, other, MODEL)
    assert fresh.records == {} and "another input" in fresh.started_over
    fresh.close()                                   # nothing recorded: nothing left behind
    assert not os.path.exists(path)
    assert sorted(p.name for p in tmp_path.iterdir()) == []      # no temporary file either


def test_a_checkpoint_of_another_model_is_not_resumed(tmp_path):
    from specray.runtime.entrypoints.batch.checkpoint import Checkpoint

    path = str(tmp_path / ".out.jsonl.specray-partial")
    items = [Item(i, [i], SamplingParams(max_tokens=3)) for i in (1, 2)]
    first = Checkpoint(path, items, MODEL)
    first.add([record(1, [1], [5])])
    first.close()
    for change in ({"target": "/models/t2"}, {"draft": "/models/d2"}, {"proposer": "ngram", "draft": None},
                   {"num_speculative_tokens": 4}, {"dtype": "bfloat16"}, {"max_model_len": 128}):
        shutil.copy(path, path + ".keep")
        other = Checkpoint(path, items, {**MODEL, **change})
        assert other.records == {} and other.started_over, change
        other.close()
        os.replace(path + ".keep", path)
    assert sorted(Checkpoint(path, items, MODEL).records) == [1]


def test_the_model_identity_names_what_decides_the_outputs(llama_pair, tmp_path):
    from specray.runtime.entrypoints.batch.checkpoint import model_identity

    t, d = llama_pair
    link = tmp_path / "target-link"
    link.symlink_to(t)

    def identity(*flags):
        p = argparse.ArgumentParser()
        add_parser(p.add_subparsers(dest="command"))
        return model_identity(runtime_config(p.parse_args(["batch", "--input", "i", "--output", "o", *flags])))

    base = identity("--target", t, "--draft", d, "-k", "3")
    assert base == {"target": os.path.realpath(t), "draft": os.path.realpath(d), "proposer": "draft",
                    "num_speculative_tokens": 3, "device": "auto", "dtype": "auto", "max_model_len": None}
    # The same directory by another path is the same model; a hub id counts as given.
    assert identity("--target", str(link), "--draft", d, "-k", "3") == base
    assert identity("--target", "org/model", "--draft", d, "-k", "3")["target"] == "org/model"
    assert identity("--target", t, "--proposer", "ngram", "-k", "3")["draft"] is None


def test_a_resumed_run_with_another_model_starts_over(llama_pair, tmp_path, ray_session, capsys):
    """A checkpoint written under one model (its records made up here, so that taking them
    shows) is resumed by the same command, and set aside by a run with another proposer."""
    from specray.runtime.entrypoints.batch.checkpoint import Checkpoint, model_identity

    t, d = llama_pair
    prompts = [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps({"prompt": pr}) + "\n" for pr in prompts))
    out = tmp_path / "out.jsonl"
    partial = str(tmp_path / ".out.jsonl.specray-partial")
    base = ["--target", t, *MODEL_FLAGS, "--input", str(inp), "--output", str(out), "--max-tokens", "4"]
    for model, resumed in ((["--draft", d], True), (["--proposer", "ngram"], False)):
        p = argparse.ArgumentParser()
        add_parser(p.add_subparsers(dest="command"))
        items, _ = read_input(str(inp), {"max_tokens": 4, "temperature": 0.0})
        fake = Checkpoint(partial, items, model_identity(runtime_config(p.parse_args(["batch", *base, "--draft", d]))))
        fake.add([record(1, prompts[0], [90, 91, 92, 93])])
        fake.close()
        capsys.readouterr()
        assert batch_main(base + model) == 0
        err = capsys.readouterr().err
        got = [json.loads(ln) for ln in out.read_text().splitlines()]
        want = hf_greedy(t, prompts, 4)
        assert [r["token_ids"] for r in got] == ([[90, 91, 92, 93]] + want[1:] if resumed else want), model
        assert ("resuming: 1 line(s)" in err) == resumed and ("starting over" in err) == (not resumed), err
        assert not os.path.exists(partial)


def test_a_symlinked_checkpoint_is_not_followed(tmp_path, capsys):
    """Neither read nor written through: the command refuses before starting anything, and
    the file the link names keeps its bytes. A checkpoint that is a FIFO is refused too
    (opening it for reading would block)."""
    from specray.runtime.entrypoints.batch.checkpoint import Checkpoint

    victim = tmp_path / "victim"
    victim.write_text("keep me\n")
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"prompt": [1, 2, 3]}\n')
    out = tmp_path / "out.jsonl"
    partial = tmp_path / ".out.jsonl.specray-partial"
    partial.symlink_to(victim)
    assert batch_main(["--target", "/no/model", "--draft", "/no/draft", "--input", str(inp), "--output", str(out),
                       "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert f"the checkpoint {partial} is a symbolic link, which specray does not follow" in err, err
    assert victim.read_text() == "keep me\n" and partial.is_symlink()
    assert sorted(p.name for p in tmp_path.iterdir()) == [".out.jsonl.specray-partial", "in.jsonl", "victim"]
    partial.unlink()
    os.mkfifo(partial)
    with pytest.raises(ValueError, match="is not a regular file"):
        Checkpoint(str(partial), [Item(1, [1], SamplingParams())], MODEL)


def test_a_checkpoint_is_rewritten_through_a_fresh_name_not_a_planted_link(tmp_path):
    """The resume rewrites the checkpoint (dropping a cut-off tail): through a new mkstemp
    file, so a link planted at the old predictable name ``<checkpoint>.tmp`` writes nowhere."""
    from specray.runtime.entrypoints.batch.checkpoint import Checkpoint

    path = str(tmp_path / ".out.jsonl.specray-partial")
    items = [Item(i, [i], SamplingParams(max_tokens=3)) for i in (1, 2)]
    first = Checkpoint(path, items, MODEL)
    first.add([record(1, [1], [5])])
    first.close()
    victim = tmp_path / "victim"
    victim.write_text("keep me\n")
    os.symlink(victim, path + ".tmp")
    again = Checkpoint(path, items, MODEL)
    again.add([record(2, [2], [6])])
    again.close()
    assert victim.read_text() == "keep me\n"
    assert not os.path.islink(path) and sorted(Checkpoint(path, items, MODEL).records) == [1, 2]


def test_checkpoint_records_are_checked_against_the_input(tmp_path, capsys, monkeypatch):
    """A record that is not an object, lacks a field, or does not fit the line it names is
    ignored with its reason, and its line runs again; only whole, fitting records stand."""
    from specray.runtime.entrypoints.batch import checkpoint as batch_checkpoint
    from specray.runtime.entrypoints.batch.checkpoint import VERSION, fingerprint
    from specray.runtime.entrypoints.batch.job import open_checkpoint

    items = [Item(1, [1, 2], SamplingParams(max_tokens=3), id="a"), Item(2, "text", SamplingParams(max_tokens=3)),
             Item(4, [4], SamplingParams(max_tokens=3, logprobs=1))]
    good = record(1, [1, 2], [5, 6], id="a")
    lines = [
        (good, None),
        ([1, 2], "not an object: list"),
        ({"line": "2"}, "line is '2', not a line number"),
        (record(3, [3], [5]), "line 3 is not an accepted line of the input"),
        ({"line": 2, "token_ids": [5]}, "line 2: prompt_token_ids is missing or not a list"),
        ({**record(2, [9], [5]), "text": None}, "line 2: text is missing or not a string"),
        ({**record(2, [9], [5]), "num_draft_tokens": True}, "line 2: num_draft_tokens is missing or not an integer"),
        (record(2, [9], [5, "x"]), "line 2: token_ids holds something other than token ids"),
        (record(1, [1, 2], [5], id="b"), "line 1: the id does not match the input's"),
        (record(2, [9], [5], id="a"), "line 2: the id does not match the input's"),
        (record(1, [1, 3], [5], id="a"), "line 1: prompt_token_ids do not match the input's prompt"),
        (record(2, [9], [5, 6, 7, 8]), "line 2: 4 tokens, more than its max_tokens 3"),
        (record(4, [4], [5]), "line 4: logprobs missing, unlike what the line asks"),
        (record(2, [9], [5], logprobs=[]), "line 2: logprobs present, unlike what the line asks"),
        ("not json at all", "a line that is not JSON"),
        (record(2, [9, 9], [7]), None),             # a string prompt: its token ids are the driver's
    ]
    out = Output(str(tmp_path / "out.jsonl"))
    path = tmp_path / ".out.jsonl.specray-partial"
    head = {"specray_checkpoint": VERSION, "input": fingerprint(items, MODEL)}
    text = [json.dumps(head)] + [r if isinstance(r, str) else json.dumps(r) for r, _ in lines]
    path.write_text("\n".join(text) + '\n{"line": 4, "pro')     # the last cut off by a kill: dropped without a word
    monkeypatch.setattr(batch_checkpoint, "model_identity", lambda config: MODEL)
    ckpt = open_checkpoint(out, items, None)
    assert ckpt.records == {1: good, 2: lines[-1][0]}
    assert ckpt.ignored == [why for _, why in lines if why]
    err = capsys.readouterr().err
    assert err.count("specray batch: ignored a checkpoint record") == len(ckpt.ignored)
    assert "specray batch: ignored a checkpoint record (line 3 is not an accepted line of the input); its line " \
           "runs again" in err
    ckpt.close()
    out.discard()
    # What stays on disk is the header and the records that stood.
    assert [json.loads(ln) for ln in path.read_text().splitlines()] == [head, good, lines[-1][0]]
