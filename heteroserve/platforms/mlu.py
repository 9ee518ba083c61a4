"""Cambricon MLUs through the `torch_mlu` extension, which registers `torch.mlu` and the "mlu" device."""

from __future__ import annotations

import importlib
import importlib.util

import torch

from heteroserve.platforms.interface import Platform


class MluPlatform(Platform):
    name = "mlu"
    device_type = "mlu"
    dist_backend = "cncl"
    ray_resource = "MLU"
    vendor_extension = "torch_mlu"

    @classmethod
    def is_available(cls) -> bool:
        if importlib.util.find_spec("torch_mlu") is None:
            return False
        importlib.import_module("torch_mlu")
        return torch.mlu.is_available()

    def supported_dtypes(self) -> list[torch.dtype]:
        dtypes = [torch.float32, torch.float16]
        if torch.mlu.is_bf16_supported():
            dtypes.append(torch.bfloat16)
        return dtypes

    def describe(self) -> dict[str, object]:
        return {**super().describe(), "mlu": torch.mlu.get_device_name()}
