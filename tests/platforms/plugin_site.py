"""Installs the example plugin into a folder and runs Python with that folder on its path."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

PLUGIN = Path(__file__).parent / "example_plugin"
REPO = Path(__file__).parents[2]


def install_example_plugin(site: Path) -> Path:
    """What `pip install` of the example plugin leaves in site-packages: the module and its dist-info."""
    shutil.copy(PLUGIN / "heteroserve_counting_platform.py", site)
    info = site / "heteroserve_counting_platform-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: heteroserve-counting-platform\nVersion: 0.1\n")
    shutil.copy(PLUGIN / "entry_points.txt", info)
    return site


def run_python(
    args: list[str], site: Path | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """A fresh interpreter with the repository (and the plugin site, if given) importable."""
    paths = [str(REPO)] + ([str(site)] if site is not None else [])
    full_env = {k: v for k, v in os.environ.items() if k != "HETEROSERVE_DEVICE"}
    full_env.update(PYTHONPATH=os.pathsep.join(paths), OMP_WAIT_POLICY="PASSIVE", **(env or {}))
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=full_env, timeout=300)


def last_json(result: subprocess.CompletedProcess) -> dict:
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout.strip().splitlines()[-1])
