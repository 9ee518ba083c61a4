"""The example plugin installed into a temporary site folder, a tiny model and the prebuilt kernel levels, for the
platform tests."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from heteroserve.platforms.cpu.kernel_variants import variants_for
from tests.model.tiny_models import TinyModel, save_tiny
from tests.platforms.plugin_site import install_example_plugin


@pytest.fixture(scope="session")
def plugin_site(tmp_path_factory) -> Path:
    return install_example_plugin(tmp_path_factory.mktemp("plugin_site"))


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory) -> TinyModel:
    """Qwen3 has q/k norms, so rms_norm runs on head-sized rows as well as hidden-sized ones."""
    return save_tiny("qwen3", tmp_path_factory.mktemp("platform_models"))


@pytest.fixture(scope="session")
def prebuilt_kernels(tmp_path_factory) -> tuple[Path, str]:
    """(folder, what the command printed): every level of this architecture, built by the command the image's
    Dockerfile runs (~70 s a level). The level runs of test_cpu_levels load these builds instead of making their
    own."""
    if not variants_for():
        pytest.skip("no prebuilt levels for this architecture")
    root = tmp_path_factory.mktemp("prebuilt")
    run = subprocess.run(
        [sys.executable, "-m", "heteroserve.entrypoints.cli", "build-kernels", "--prebuilt", "--output", str(root)],
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parents[2],
        timeout=1200,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    return root, run.stdout
