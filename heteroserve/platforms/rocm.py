"""AMD GPUs and Hygon DCUs through torch's ROCm (HIP) build, which keeps the "cuda" device type."""

from __future__ import annotations

import torch

from heteroserve.platforms.interface import Platform


class RocmPlatform(Platform):
    name = "rocm"
    device_type = "cuda"  # HIP torch answers to torch.cuda and the "cuda" device
    dist_backend = "nccl"  # RCCL, under NCCL's name

    @classmethod
    def is_available(cls) -> bool:
        return torch.version.hip is not None and torch.cuda.is_available()

    def supported_dtypes(self) -> list[torch.dtype]:
        dtypes = [torch.float32, torch.float16]
        if torch.cuda.is_bf16_supported():
            dtypes.append(torch.bfloat16)
        return dtypes

    def describe(self) -> dict[str, object]:
        props = torch.cuda.get_device_properties(0)
        return {
            **super().describe(),
            "gpu": props.name,
            "arch": getattr(props, "gcnArchName", None),
            "hip": torch.version.hip,
        }
