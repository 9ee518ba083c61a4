"""Tensors of a Hugging Face checkpoint folder (one or more safetensors shards)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open


def iterate_safetensors(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{folder} has a config.json but no .safetensors weights")
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as handle:
                for name in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
                    yield name, handle.get_tensor(name)
        except Exception as exc:  # safetensors raises its own error types for damaged files
            raise ValueError(f"cannot read weights from {file}: {exc} (truncated or not a safetensors file?)") from exc
