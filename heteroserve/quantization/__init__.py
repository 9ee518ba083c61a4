"""Quantized weight formats. Each format (GGML blocks, GPTQ, AWQ, load-time int4/int8) turns checkpoint tensors
into a canonical compressed weight; platforms choose the kernel that multiplies by it (heteroserve.platforms)."""

from heteroserve.quantization.act_order import PermutedInput
from heteroserve.quantization.int4 import Int4Weight
from heteroserve.quantization.int8 import Int8Weight
from heteroserve.quantization.weight import CompressedWeight, ShardableWeight

__all__ = ["CompressedWeight", "Int4Weight", "Int8Weight", "PermutedInput", "ShardableWeight"]
