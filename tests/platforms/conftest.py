"""The example plugin installed into a temporary site folder, and a tiny model, for the platform tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.model.tiny_models import TinyModel, save_tiny
from tests.platforms.plugin_site import install_example_plugin


@pytest.fixture(scope="session")
def plugin_site(tmp_path_factory) -> Path:
    return install_example_plugin(tmp_path_factory.mktemp("plugin_site"))


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory) -> TinyModel:
    """Qwen3 has q/k norms, so rms_norm runs on head-sized rows as well as hidden-sized ones."""
    return save_tiny("qwen3", tmp_path_factory.mktemp("platform_models"))
