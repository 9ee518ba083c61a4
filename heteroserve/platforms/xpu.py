"""Intel GPUs (Arc, Data Center GPU Max) through torch's built-in XPU backend (torch >= 2.5)."""

from __future__ import annotations

import torch

from heteroserve.platforms.interface import Platform


class XpuPlatform(Platform):
    name = "xpu"
    device_type = "xpu"
    dist_backend = "xccl"  # built into torch since 2.7; older stacks used oneCCL's "ccl"

    @classmethod
    def is_available(cls) -> bool:
        return hasattr(torch, "xpu") and torch.xpu.is_available()

    def supported_dtypes(self) -> list[torch.dtype]:
        dtypes = [torch.float32, torch.float16]
        if torch.xpu.is_bf16_supported():
            dtypes.append(torch.bfloat16)
        return dtypes

    def describe(self) -> dict[str, object]:
        return {**super().describe(), "gpu": torch.xpu.get_device_name()}
