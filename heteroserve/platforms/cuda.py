"""NVIDIA GPUs through torch's CUDA build."""

from __future__ import annotations

import torch

from heteroserve.platforms.interface import Platform


class CudaPlatform(Platform):
    name = "cuda"
    device_type = "cuda"
    dist_backend = "nccl"
    gpu_memory_utilization = 0.9

    @classmethod
    def is_available(cls) -> bool:
        return torch.cuda.is_available()

    def supported_dtypes(self) -> list[torch.dtype]:
        dtypes = [torch.float32, torch.float16]
        if torch.cuda.is_bf16_supported():
            dtypes.append(torch.bfloat16)
        return dtypes

    def kv_cache_budget_bytes(self, requested: int | None) -> int:
        if requested is not None:
            return requested
        free, total = torch.cuda.mem_get_info()
        in_use = total - free
        return max(int(total * self.gpu_memory_utilization) - in_use, 0)

    def synchronize(self) -> None:
        torch.cuda.synchronize()

    def describe(self) -> dict[str, object]:
        return {**super().describe(), "gpu": torch.cuda.get_device_name(), "cuda": torch.version.cuda}
