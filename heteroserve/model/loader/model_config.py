"""A checkpoint folder's transformers config: config.json through AutoConfig, or a remote-code layout's mapping."""

from __future__ import annotations

import json
from pathlib import Path

from transformers import AutoConfig, PretrainedConfig

from heteroserve.model.loader.remote_code_layouts import read_remote_code_config, remote_code_layout


def read_model_config(folder: Path) -> PretrainedConfig:
    layout = remote_code_layout(folder)
    if layout is not None:
        return read_remote_code_config(folder, layout)
    try:
        return AutoConfig.from_pretrained(folder)
    except (ValueError, OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{folder}/config.json is not a usable model config: {exc}") from exc
