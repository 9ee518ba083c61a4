"""Which pre-quantised format a Hugging Face checkpoint folder holds, and its packed tensors as our weights.

The format comes from config.json's `quantization_config` (`quant_method`: gptq, awq) or, for older AutoGPTQ
folders, a separate quantize_config.json. A quantised linear `prefix` is stored as `prefix.qweight`,
`prefix.qzeros`, `prefix.scales` (and GPTQ's `prefix.g_idx`) instead of `prefix.weight`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from transformers import PretrainedConfig

from heteroserve.quantization.awq import AwqConfig, awq_weight
from heteroserve.quantization.gptq import GptqConfig, gptq_weight
from heteroserve.quantization.mxfp4 import dequantize_stacks

CHECKPOINT_FORMATS = {"gptq": (GptqConfig, gptq_weight), "awq": (AwqConfig, awq_weight)}
QuantizedConfig = GptqConfig | AwqConfig
# gpt-oss's MXFP4 experts: dequantised as they stream in (mxfp4.py), so the checkpoint loads as a float one.
MXFP4 = "mxfp4"


def checkpoint_quantization(folder: Path, hf_config: PretrainedConfig) -> tuple[str, QuantizedConfig | None] | None:
    """(method, its settings) of a pre-quantised checkpoint, or None for a float one."""
    settings = getattr(hf_config, "quantization_config", None)
    if settings is None and (folder / "quantize_config.json").is_file():
        settings = json.loads((folder / "quantize_config.json").read_text())
        settings.setdefault("quant_method", "gptq")  # AutoGPTQ's file predates the field
    if settings is None:
        return None
    if not isinstance(settings, dict):
        settings = settings.to_dict()
    method = str(settings.get("quant_method", "")).lower()
    if method == MXFP4:
        return method, None
    if method not in CHECKPOINT_FORMATS:
        raise ValueError(
            f"{folder}: quantization method {method!r} is not supported (supported: {', '.join(CHECKPOINT_FORMATS)})"
        )
    return method, CHECKPOINT_FORMATS[method][0].from_dict(settings)


def unpack_checkpoint(
    tensors: Iterable[tuple[str, torch.Tensor]], method: str, config: QuantizedConfig, dequantize: bool = False
) -> Iterator[tuple[str, object]]:
    """Float tensors pass through; each linear's packed tensors become one `prefix.weight` (float if
    `dequantize`; MXFP4 stacks always are). A linear with only some of its packed tensors is an error naming what
    is missing."""
    if method == MXFP4:
        yield from dequantize_stacks(tensors)
        return
    build = CHECKPOINT_FORMATS[method][1]
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors:
        prefix, _, suffix = name.rpartition(".")
        if suffix in config.tensor_suffixes:
            pending.setdefault(prefix, {})[suffix] = tensor
        else:
            yield name, tensor
    for prefix, parts in pending.items():
        missing = [s for s in config.required_suffixes if s not in parts]
        if missing:
            present = ", ".join(f"{prefix}.{s}" for s in parts)
            raise ValueError(
                f"{method.upper()} checkpoint is missing tensor(s) {', '.join(f'{prefix}.{s}' for s in missing)} "
                f"(it has {present})"
            )
        weight = build(prefix, parts, config)
        yield f"{prefix}.weight", weight.dequantize() if dequantize else weight
