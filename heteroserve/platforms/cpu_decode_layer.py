"""A decoder layer of a decode-only step in one C++ call (csrc/decode_layer.cpp), for float32 activations with
packed float32 or 4-bit projections.

The kernels are the ones the model otherwise calls one at a time; what goes is the Python between them: at one
token a step, ~20 operator calls a layer from Python cost about a quarter of the step's time.
"""

from __future__ import annotations

import torch

from heteroserve.platforms.cpu_int4 import DECODE_VNNI_MAX_ROWS, PANEL_MIN_ROWS, CpuInt4Weight
from heteroserve.platforms.cpu_packed import CpuPackedWeight
from heteroserve.platforms.operators import DecodeLayerWeights


def _tensors(projection: CpuPackedWeight | CpuInt4Weight) -> list[torch.Tensor]:
    """The projection as decode_layer.cpp reads it: [panels] or [packed, scales_and_zeros, scale_zero]."""
    if isinstance(projection, CpuPackedWeight):
        return [projection.packed]
    return [projection.packed, projection.scales_and_zeros, projection.scale_zero]


class CpuFusedDecodeLayer:
    kernel_name = "cpp fused decode layer"

    def __init__(self, w: DecodeLayerWeights) -> None:
        projections = (w.qkv, w.o_proj, w.gate_up, w.down)
        self.norms = [w.input_norm, w.post_norm, *(w.qk_norms or ())]
        self.projections = [_tensors(p) for p in projections]
        self.out_features = [p.shape[0] for p in projections]
        self.qkv_bias, self.eps, self.num_heads, self.scale = w.qkv_bias, w.eps, w.num_heads, w.scale
        self.cos, self.sin = w.cos, w.sin
        self.vnni_max_rows = DECODE_VNNI_MAX_ROWS

    def __call__(self, x, positions, k_cache, v_cache, meta) -> torch.Tensor:
        return torch.ops.heteroserve.decode_layer(
            x,
            self.norms,
            *self.projections,
            self.out_features,
            self.qkv_bias,
            self.eps,
            positions,
            self.cos,
            self.sin,
            k_cache,
            v_cache,
            meta.slot_mapping,
            meta.decode_block_tables,
            meta.decode_mask,
            self.num_heads,
            self.scale,
            PANEL_MIN_ROWS,
            self.vnni_max_rows,
        )


def fuse_decode_layer(w: DecodeLayerWeights) -> CpuFusedDecodeLayer | None:
    """Layers whose projections are all packed float32 or torch-layout 4-bit, in float32; others (8-bit weights,
    act-order permutations) stay operator by operator."""
    projections = (w.qkv, w.o_proj, w.gate_up, w.down)
    if not all(isinstance(p, (CpuPackedWeight, CpuInt4Weight)) for p in projections):
        return None
    if any(t.dtype != torch.float32 for t in (w.input_norm, w.post_norm, *(w.qk_norms or ()), w.cos)):
        return None
    return CpuFusedDecodeLayer(w)


fuse_decode_layer.kernel_name = CpuFusedDecodeLayer.kernel_name
