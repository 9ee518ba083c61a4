"""Apple-silicon GPUs through Metal Performance Shaders; memory is shared with the host."""

from __future__ import annotations

import torch

from heteroserve.platforms.interface import Platform


class MpsPlatform(Platform):
    name = "mps"
    device_type = "mps"
    dist_backend = "gloo"  # no device collectives on MPS
    collectives_through_host = True
    ray_resource = "CPU"

    @classmethod
    def is_available(cls) -> bool:
        return torch.backends.mps.is_available()

    def supported_dtypes(self) -> list[torch.dtype]:
        return [torch.float32, torch.float16, torch.bfloat16]  # bfloat16 needs macOS 14

    def memory_info(self) -> tuple[int, int]:
        """Metal's recommended working-set size stands in for total memory (unified with the host's)."""
        total = torch.mps.recommended_max_memory()
        return max(total - torch.mps.driver_allocated_memory(), 0), total
