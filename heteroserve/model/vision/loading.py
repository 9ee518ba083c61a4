"""Splits a vision-language checkpoint into its language model and its vision tower, and builds the tower.

Checkpoints name the language model `model.*` (Qwen2-VL, Qwen2.5-VL) or `model.language_model.*` (newer
transformers), and the tower `visual.*` or `model.visual.*`; both layouts load.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch
from transformers import PretrainedConfig

from heteroserve.model.vision.encoder import VisionEncoder
from heteroserve.model.vision.spec import VisionSpec

_RENAMES = (("model.language_model.", "model."), ("model.visual.", "visual."))
# Qwen3-VL's names for the same parts -> ours (the Qwen2-VL names).
_QWEN3_MERGER = re.compile(r"(merger\.|deepstack_merger_list\.\d+\.)(norm|linear_fc1|linear_fc2)\.")
_QWEN3_MERGER_PARTS = {"norm": "ln_q.", "linear_fc1": "mlp.0.", "linear_fc2": "mlp.2."}


def split_vision_tensors(
    tensors: Iterable[tuple[str, torch.Tensor]], vision: dict[str, torch.Tensor]
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields the language model's tensors under text-model names; collects the tower's into `vision`."""
    for name, tensor in tensors:
        for old, new in _RENAMES:
            if name.startswith(old):
                name = new + name.removeprefix(old)
                break
        if name.startswith("visual."):
            vision[name.removeprefix("visual.")] = tensor
        else:
            yield name, tensor


def build_vision_encoder(
    hf_config: PretrainedConfig, tensors: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device
) -> VisionEncoder:
    encoder = VisionEncoder(VisionSpec.from_hf_config(hf_config.model_type, hf_config.vision_config))
    if hf_config.model_type == "qwen3_vl":
        tensors = {_qwen3_name(name): tensor for name, tensor in tensors.items()}
    missing, unexpected = encoder.load_state_dict(tensors, strict=False)
    if missing or unexpected:
        raise ValueError(f"vision tower tensors do not match: missing {missing[:5]}, unexpected {unexpected[:5]}")
    return encoder.to(device=device, dtype=dtype).eval()


def _qwen3_name(name: str) -> str:
    name = _QWEN3_MERGER.sub(lambda m: m[1] + _QWEN3_MERGER_PARTS[m[2]], name)
    return name.replace(".mlp.linear_fc1.", ".mlp.fc1.").replace(".mlp.linear_fc2.", ".mlp.fc2.")
