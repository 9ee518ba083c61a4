"""NVIDIA GPUs through torch's CUDA build."""

from __future__ import annotations

import torch

from heteroserve.platforms.graph_capture import GraphCapture
from heteroserve.platforms.interface import Platform


class CudaPlatform(Platform):
    name = "cuda"
    device_type = "cuda"
    dist_backend = "nccl"

    @classmethod
    def is_available(cls) -> bool:
        return torch.version.hip is None and torch.cuda.is_available()

    def supported_dtypes(self) -> list[torch.dtype]:
        dtypes = [torch.float32, torch.float16]
        if torch.cuda.is_bf16_supported():
            dtypes.append(torch.bfloat16)
        return dtypes

    def graph_capture(self) -> GraphCapture:
        return GraphCapture("CUDA graphs", torch.cuda.CUDAGraph, torch.cuda.graph, torch.cuda.graph_pool_handle)

    def describe(self) -> dict[str, object]:
        return {**super().describe(), "gpu": torch.cuda.get_device_name(), "cuda": torch.version.cuda}
