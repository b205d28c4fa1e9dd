"""``specray serve --http``'s own flags (the server itself: test_serve.py, test_http.py)."""

from __future__ import annotations

import argparse

import pytest

from specray.runtime.entrypoints.openai.serve_http import replicas, served_name


def test_http_replicas_take_n_or_min_max():
    assert replicas("3") == (3, 3)
    assert replicas("1,4") == (1, 4)
    for bad in ("0", "4,2", "a", "1,2,3", ""):
        with pytest.raises(argparse.ArgumentTypeError, match="--http-replicas"):
            replicas(bad)


def test_the_served_name_is_the_target_directorys_or_the_hub_id(tmp_path):
    (tmp_path / "SmolLM2-135M").mkdir()
    assert served_name(f"{tmp_path}/SmolLM2-135M/") == "SmolLM2-135M"
    assert served_name("HuggingFaceTB/SmolLM2-135M-Instruct") == "HuggingFaceTB/SmolLM2-135M-Instruct"


def _args(*argv: str):
    from specray.runtime.entrypoints import serve

    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    serve.add_parser(sub)
    return parser.parse_args(["serve", "--http", *argv])


def test_the_doors_flags_and_the_key_from_the_environment():
    from specray.runtime.entrypoints.openai.guard import DEFAULT_MAX_BODY_BYTES
    from specray.runtime.entrypoints.openai.serve_http import doors

    d = doors(_args(), environ={})
    assert d.api_key is None and d.max_body_bytes == DEFAULT_MAX_BODY_BYTES
    assert d.allowed_hosts == {"127.0.0.1", "127.0.0.1:8000", "localhost", "localhost:8000", "[::1]", "[::1]:8000"}
    d = doors(_args("--port", "9000", "--allowed-hosts", "api.example, 10.0.0.2:80", "--max-body-bytes", "1024"),
              environ={"SPECRAY_API_KEY": "sk-env"})
    assert d.api_key.value == "sk-env" and d.max_body_bytes == 1024
    assert d.allowed_hosts == {"api.example", "api.example:9000", "10.0.0.2:80"}
    assert doors(_args("--api-key", "sk-flag"), environ={"SPECRAY_API_KEY": "sk-env"}).api_key.value == "sk-flag"
    assert doors(_args(), environ={"SPECRAY_API_KEY": ""}).api_key is None
    assert doors(_args("--allowed-hosts", "*"), environ={}).allowed_hosts is None
    with pytest.raises(ValueError, match="--api-key is empty"):
        doors(_args("--api-key", " "), environ={})
    with pytest.raises(ValueError, match="allowed_hosts entry"):
        doors(_args("--allowed-hosts", "http://x"), environ={})
    for bad in (["--max-body-bytes", "0"], ["--max-body-bytes", "4MB"], ["--allowed-hosts", ","]):
        with pytest.raises(SystemExit):
            _args(*bad)


def test_the_key_is_not_shown_by_help(monkeypatch, capsys):
    from specray.runtime.entrypoints import cli

    monkeypatch.setenv("SPECRAY_API_KEY", "sk-do-not-print")
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["serve", "--help"])
    out = capsys.readouterr().out
    assert "--api-key" in out and "sk-do-not-print" not in out
