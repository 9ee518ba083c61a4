"""Huawei Ascend NPUs through the `torch_npu` extension, which registers `torch.npu` and the "npu" device."""

from __future__ import annotations

import importlib
import importlib.util

import torch

from heteroserve.platforms.interface import Platform


class NpuPlatform(Platform):
    name = "npu"
    device_type = "npu"
    dist_backend = "hccl"
    ray_resource = "NPU"
    vendor_extension = "torch_npu"

    @classmethod
    def is_available(cls) -> bool:
        # find_spec looks for the package without importing it: free when torch_npu is absent.
        if importlib.util.find_spec("torch_npu") is None:
            return False
        importlib.import_module("torch_npu")
        return torch.npu.is_available()

    def supported_dtypes(self) -> list[torch.dtype]:
        dtypes = [torch.float32, torch.float16]
        if torch.npu.is_bf16_supported():  # Atlas A2/A3 (910B and later); not 310P
            dtypes.append(torch.bfloat16)
        return dtypes

    def describe(self) -> dict[str, object]:
        return {**super().describe(), "npu": torch.npu.get_device_name()}
