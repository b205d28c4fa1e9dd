"""The README's Python examples run as written, from a directory outside the clone (they
name the built-in pair through ``specray.builtin_model``, not a relative path)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile

import pytest
from specray_testing import ROOT

BLOCKS = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)


def run_block(code: str, cwd) -> subprocess.CompletedProcess:
    env = dict(os.environ, RAY_TMPDIR=tempfile.mkdtemp(prefix="srr", dir="/tmp"))
    env.pop("RAY_ADDRESS", None)
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=300)


def test_the_api_example_runs_from_another_directory(tmp_path):
    assert "builtin_model(" in BLOCKS[0] and "models/" not in BLOCKS[0]
    p = run_block(BLOCKS[0], tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    rate, mean_len = p.stdout.strip().splitlines()[-1].split()[-2:]
    assert 0.0 <= float(rate) <= 1.0 and 1.0 <= float(mean_len) <= 5.0


@pytest.mark.real_model
def test_the_chat_example_runs(tmp_path):
    from specray.runtime import model_store

    try:
        model_store.fetch("smollm2")
    except model_store.ModelNotFound as e:
        pytest.skip(f"SmolLM2-135M-Instruct cannot be fetched here: {e}")
    imports = "\n".join(ln for ln in BLOCKS[0].splitlines() if ln.startswith(("import ", "from ")))
    (chat,) = [b for b in BLOCKS if ".chat(" in b]
    p = run_block(imports + "\n" + chat, tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "Paris" in p.stdout
