"""4-bit projections kept compressed in the graph as onnxruntime's `MatMulNBits` (com.microsoft domain).

Our `Int4Weight` holds w = (q - 8) * scale + zero per group of input columns; MatMulNBits computes
w = (q - zero_point) * scale with one float zero point per group, so zero_point = 8 - zero / scale. Its packed
blocks are ours reshaped: [N, K / group, group / 2] bytes, even k in the low nibble. A torch custom op stands for
the product while tracing and is translated to the node by the exporter.
"""

from __future__ import annotations

import onnx
import onnxscript
import torch
from torch import nn

from heteroserve.quantization.int4 import Int4Weight

DOMAIN = "com.microsoft"


def _register_schema() -> onnx.defs.OpSchema:
    """onnx knows none of onnxruntime's contrib ops; the exporter and the checker need this one's signature (the
    inputs and attributes used here, as onnxruntime's ContribOperators.md defines them)."""
    if onnx.defs.has("MatMulNBits", DOMAIN):
        return onnx.defs.get_schema("MatMulNBits", 1, DOMAIN)
    param = onnx.defs.OpSchema.FormalParameter
    attr = onnx.defs.OpSchema.Attribute
    int_attr = onnx.defs.OpSchema.AttrType.INT
    schema = onnx.defs.OpSchema(
        "MatMulNBits",
        DOMAIN,
        1,
        inputs=[param("A", "T1"), param("B", "T2"), param("scales", "T1"), param("zero_points", "T1")],
        outputs=[param("Y", "T1")],
        type_constraints=[("T1", ["tensor(float)", "tensor(float16)"], ""), ("T2", ["tensor(uint8)"], "")],
        attributes=[attr("K", int_attr), attr("N", int_attr), attr("bits", int_attr), attr("block_size", int_attr)],
    )
    onnx.defs.register_schema(schema)
    return schema


MATMUL_NBITS = onnxscript.values.Op(onnxscript.values.Opset(DOMAIN, 1), "MatMulNBits", _register_schema())
BLOCK_SIZES = (16, 32, 64, 128, 256)  # the group sizes MatMulNBits takes


@torch.library.custom_op("heteroserve_export::matmul_nbits", mutates_args=())
def matmul_nbits(
    x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, k: int, n: int, block: int
) -> torch.Tensor:
    """x [..., K] times the 4-bit weight [N, K] transposed; eager: the weight dequantised."""
    q = torch.stack((packed & 15, packed >> 4), dim=-1).reshape(n, k).to(scale.dtype)
    groups = (q.reshape(n, k // block, block) - zero_point.reshape(n, -1, 1)) * scale.reshape(n, -1, 1)
    return torch.matmul(x, groups.reshape(n, k).t().to(x.dtype))


@matmul_nbits.register_fake
def _(x, packed, scale, zero_point, k, n, block):
    return x.new_empty((*x.shape[:-1], n))


def matmul_nbits_onnx(x, packed, scale, zero_point, k: int, n: int, block: int):
    return MATMUL_NBITS(x, packed, scale, zero_point, K=k, N=n, bits=4, block_size=block)


TRANSLATIONS = {torch.ops.heteroserve_export.matmul_nbits.default: matmul_nbits_onnx}


def fits_matmul_nbits(weight: object) -> bool:
    """An Int4Weight whose groups MatMulNBits can hold (a zero scale with a nonzero zero has no zero point)."""
    if type(weight) is not Int4Weight or weight.group_size not in BLOCK_SIZES:
        return False
    return not bool(((weight.scale == 0) & (weight.zero != 0)).any())


class NBitsProjection(nn.Module):
    """A 4-bit projection's blocks, scales and zero points as buffers, in the layout MatMulNBits reads."""

    def __init__(self, weight: Int4Weight, dtype: torch.dtype) -> None:
        super().__init__()
        self.n, self.k = weight.shape
        self.block = weight.group_size
        self.register_buffer("packed", weight.packed.reshape(self.n, self.k // self.block, self.block // 2))
        scale = weight.scale.float()
        zero_point = torch.where(scale != 0, 8 - weight.zero / scale.where(scale != 0, 1.0), 0.0)
        self.register_buffer("scale", scale.reshape(-1).to(dtype))
        self.register_buffer("zero_point", zero_point.reshape(-1).to(dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return matmul_nbits(x, self.packed, self.scale, self.zero_point, self.k, self.n, self.block)
