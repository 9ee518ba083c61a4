"""A decoder layer of a decode-only step in one C++ call (csrc/decode_layer.cpp) on float32 packed weights.

The kernels are the ones the model otherwise calls one at a time; what goes is the Python between them: at one
token a step, ~20 operator calls a layer from Python cost about a quarter of the step's time.
"""

from __future__ import annotations

import torch

from heteroserve.platforms.cpu_packed import CpuPackedWeight
from heteroserve.platforms.operators import DecodeLayerWeights


class CpuFusedDecodeLayer:
    kernel_name = "cpp fused decode layer"

    def __init__(self, w: DecodeLayerWeights) -> None:
        projections = (w.qkv, w.o_proj, w.gate_up, w.down)
        self.weights = [w.input_norm, w.qkv.packed, w.o_proj.packed, w.post_norm, w.gate_up.packed, w.down.packed]
        self.out_features = [p.n for p in projections]
        self.qkv_bias, self.eps, self.num_heads, self.scale = w.qkv_bias, w.eps, w.num_heads, w.scale
        self.cos, self.sin = w.cos, w.sin

    def __call__(self, x, positions, k_cache, v_cache, meta) -> torch.Tensor:
        return torch.ops.heteroserve.decode_layer(
            x,
            self.weights,
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
        )


def fuse_decode_layer(w: DecodeLayerWeights) -> CpuFusedDecodeLayer | None:
    """Layers whose projections are all packed float32 (the C++ library's GEMM); others (4- and 8-bit weights)
    stay operator by operator."""
    projections = (w.qkv, w.o_proj, w.gate_up, w.down)
    if not all(isinstance(p, CpuPackedWeight) for p in projections):
        return None
    if any(t.dtype != torch.float32 for t in (w.input_norm, w.post_norm, w.cos)):
        return None
    return CpuFusedDecodeLayer(w)


fuse_decode_layer.kernel_name = CpuFusedDecodeLayer.kernel_name
