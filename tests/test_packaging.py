"""The distribution installs one top-level package, ``specray``, holding the repository's
runtime/, scheduler/ and workers/ folders as subpackages of their own names (no generic
``runtime`` in site-packages)."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(out), str(ROOT)], check=True, capture_output=True, timeout=300)
    (found,) = out.glob("specray-*.whl")
    return found


def test_wheel_installs_only_specray(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"specray"}
    for module in ("specray/__init__.py", "specray/runtime/client.py", "specray/runtime/bench/run.py",
                   "specray/scheduler/scheduler.py", "specray/workers/model_runner.py",
                   "specray/scheduler/adaptive/policy.py"):
        assert module in names
    entry = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert "specray = specray.runtime.entrypoints.cli:main" in entry


def test_public_names_import_without_loading_ray_for_the_scheduler():
    code = ("import sys, specray.scheduler; assert 'ray' not in sys.modules and 'torch' not in sys.modules; "
            "from specray import SpecRuntime, RuntimeConfig, SamplingParams, RequestOutput, Overloaded; "
            "print(SpecRuntime.__module__)")
    out = subprocess.run([sys.executable, "-c", code], cwd="/", check=True, capture_output=True, text=True)
    assert out.stdout.strip() == "specray.runtime.client"


def test_an_installed_specray_carries_the_builtin_pair(wheel, tmp_path):
    """Installed from the wheel (no clone around it), ``specray.builtin_model`` finds the
    pair inside the package: ``specray generate`` works for whoever pip-installed it."""
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)],
                   check=True, capture_output=True, timeout=300)
    # -S: without site-packages (and the editable install of this checkout in them).
    code = "import specray; print(specray.__file__); print(specray.builtin_model('tiny-target'))"
    out = subprocess.run([sys.executable, "-S", "-c", code], cwd="/", env={"PYTHONPATH": str(site)},
                         check=True, capture_output=True, text=True).stdout.split()
    assert out == [str(site / "specray" / "__init__.py"), str(site / "specray" / "models" / "tiny-target")]
    for name in ("config.json", "model.safetensors", "tokenizer_config.json"):
        assert (site / "specray" / "models" / "tiny-target" / name).is_file()
        assert (site / "specray" / "models" / "tiny-draft" / name).is_file()
    # The chat template: the default HTTP server answers chat requests.
    assert (site / "specray" / "models" / "tiny-target" / "chat_template.jinja").is_file()
