"""A decoder layer of a decode-only step in one C++ call (csrc/decode_layer.cpp): float32 activations with packed
float32, 4-bit or grouped 8-bit projections, or bfloat16 activations with packed bfloat16 projections; the MLP
dense, or a mixture of experts whose routed experts and routing the CPU's experts fuser bound (moe_experts.py),
with shared experts, gated or not, or none.

The kernels are the ones the model otherwise calls one at a time; what goes is the Python between them: at one
token a step the ~20 operator calls a layer makes from Python are a share of the step worth removing, most of all
with 4-bit weights, whose products are shortest (docs/PLATFORMS.md has the figures).
"""

from __future__ import annotations

import torch

from heteroserve.model.arch import ImplementedTraits, unimplemented_traits
from heteroserve.platforms.cpu.moe_experts import PROJECTION_FORMS, CpuFusedExperts, projection_form
from heteroserve.platforms.operators import DecodeLayerWeights

# The layer traits decode_layer.cpp implements: q/k/v biases, per-head q/k norms, sliding windows (through the
# decode mask) and any rotary table (the layer's own cos/sin).
IMPLEMENTED_TRAITS: ImplementedTraits = {
    "qkv_bias": None,
    "qk_norm": frozenset({"head"}),
    "sliding_window": None,
    "rotary": None,
    "moe": None,  # what fuse_decode_layer takes of a mixture of experts is checked there
}


class CpuFusedDecodeLayer:
    kernel_name = "cpp fused decode layer"

    def __init__(self, w: DecodeLayerWeights) -> None:
        mlp = () if w.experts is not None else (w.gate_up, w.down)
        projections = (w.qkv, w.o_proj, *mlp)
        self.norms = [w.input_norm, w.post_norm, *(w.qk_norms or ())]
        self.projections = [PROJECTION_FORMS[type(p)](p) for p in projections]
        self.out_features = [p.shape[0] for p in projections]
        self.qkv_bias, self.eps, self.num_heads, self.scale = w.qkv_bias, w.eps, w.num_heads, w.scale
        self.cos, self.sin = w.cos, w.sin
        self.experts = w.experts
        shared = [p for p in (w.shared_gate_up, w.shared_down) if p is not None]
        self.shared = [PROJECTION_FORMS[type(p)](p) for p in shared] or [[], []]
        self.shared_features = shared[0].shape[0] if shared else 0
        self.shared_gate = w.shared_gate

    @property
    def takes_lora(self) -> bool:
        """Whether a step with adapter rows runs here (a dense layer: the adapters' products are chained in);
        a mixture of experts' layer leaves such steps to the model's Python path."""
        return self.experts is None

    def __call__(self, x, positions, k_cache, v_cache, meta, lora=None) -> torch.Tensor:
        """lora: None, or the layer's adapter matrices and the step's segments (operators.FusedDecodeLayer)."""
        layer = (
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
        )
        if self.experts is None:
            if lora is None:
                return torch.ops.heteroserve.decode_layer(*layer, [], None)
            return torch.ops.heteroserve.decode_layer(*layer, *lora)
        return torch.ops.heteroserve.decode_moe_layer(
            *layer,
            *self.experts.router_arguments(),
            self.experts.weights,
            *self.shared,
            self.shared_features,
            self.shared_gate,
        )


def fuse_decode_layer(w: DecodeLayerWeights) -> CpuFusedDecodeLayer | None:
    """Layers in float32 or bfloat16 (the norms' dtype) whose projections all take a form the C++ kernels chain
    (`projection_form`); others (per-channel
    8-bit weights on torch's kernel, act-order permutations, a float32 projection among bfloat16 ones), layers
    with a trait outside IMPLEMENTED_TRAITS, M-RoPE or tensor parallelism, and mixtures of experts whose experts
    run expert by expert, stay operator by operator."""
    if unimplemented_traits(w.traits, IMPLEMENTED_TRAITS) or w.multimodal_rope or w.tensor_parallel_size != 1:
        return None
    dtype = w.input_norm.dtype
    if dtype not in (torch.float32, torch.bfloat16) or w.cos.dtype != torch.float32:
        return None
    if any(t.dtype != dtype for t in (w.post_norm, *(w.qk_norms or ()))):
        return None
    if "moe" in w.traits:
        if not isinstance(w.experts, CpuFusedExperts):
            return None
        mlp = [p for p in (w.shared_gate_up, w.shared_down) if p is not None]
    else:
        mlp = [w.gate_up, w.down]
    if not all(projection_form(p, dtype) is not None for p in (w.qkv, w.o_proj, *mlp)):
        return None
    return CpuFusedDecodeLayer(w)


fuse_decode_layer.kernel_name = CpuFusedDecodeLayer.kernel_name
