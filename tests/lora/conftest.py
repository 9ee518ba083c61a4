"""The tiny base models and the peft-made adapters the LoRA tests share (built once per session)."""

from __future__ import annotations

import pytest

from tests.lora.adapters import ATTENTION, MLP, TinyAdapter, save_adapter
from tests.model.tiny_models import save_tiny


@pytest.fixture(scope="session")
def base(tmp_path_factory):
    return save_tiny("qwen2", tmp_path_factory.mktemp("lora-base"))  # qkv biases: the adapter adds to them


@pytest.fixture(scope="session")
def adapters(base, tmp_path_factory) -> list[TinyAdapter]:
    """Four adapters that differ in what PEFT lets them differ in: targets, rank, alpha, rsLoRA."""
    root = tmp_path_factory.mktemp("lora-adapters")
    model = base.reference.model
    return [
        save_adapter(model, root / "all", "all", 1, rank=8, seed=1),
        save_adapter(model, root / "qv", "qv", 2, rank=4, alpha=8, targets=["q_proj", "v_proj"], seed=2),
        save_adapter(model, root / "mlp", "mlp", 3, rank=16, alpha=32, targets=MLP, seed=3),
        save_adapter(model, root / "rs", "rs", 4, rank=8, alpha=4, targets=ATTENTION, use_rslora=True, seed=4),
    ]
