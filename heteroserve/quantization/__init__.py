"""Quantized weight formats. Each format turns checkpoint tensors into a canonical compressed weight;
platforms choose the kernel that multiplies by it (heteroserve.platforms)."""

from heteroserve.quantization.int4 import Int4Weight

__all__ = ["Int4Weight"]
