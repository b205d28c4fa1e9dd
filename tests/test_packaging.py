"""The distribution installs one top-level package, ``specray``, holding the repository's
runtime/, scheduler/ and workers/ folders (no generic ``runtime`` in site-packages)."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_wheel_installs_only_specray(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(tmp_path), str(ROOT)], check=True, capture_output=True, timeout=300)
    (wheel,) = tmp_path.glob("specray-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"specray"}
    for module in ("specray/__init__.py", "specray/client.py", "specray/scheduler/scheduler.py",
                   "specray/workers/model_runner.py"):
        assert module in names
    entry = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert "specray = specray.cli:main" in entry


def test_public_names_import_without_loading_ray_for_the_scheduler():
    code = ("import sys, specray.scheduler; assert 'ray' not in sys.modules and 'torch' not in sys.modules; "
            "from specray import SpecRuntime, RuntimeConfig, SamplingParams, RequestOutput, Overloaded; "
            "print(SpecRuntime.__module__)")
    out = subprocess.run([sys.executable, "-c", code], cwd="/", check=True, capture_output=True, text=True)
    assert out.stdout.strip() == "specray.client"
