"""A mixture-of-experts layer's routed experts for a step in one C++ call (csrc/moe_experts.cpp), and its router's
product on the float32 GEMM, whose rows get the same bits at every row count; the routing (a softmax or sigmoid's
top-k, a correction bias, group-limited choice, renormalisation, a routed scale) is computed there too, so the
fused decode layer (csrc/decode_layer.cpp) and the model's Python path choose a token's experts alike.

model/moe.py runs each chosen expert as three operator calls from Python (gate/up product, activation, down
product) and groups and scatters the step's rows with torch operators around them; at one token a step that
Python costs more than the experts' products (docs/PLATFORMS.md). The kernel does the same work with the same
kernels in the same order, so a token gets the same bits either way.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from heteroserve.model.arch import MoESpec
from heteroserve.platforms.cpu.int4 import CpuInt4Weight
from heteroserve.platforms.cpu.int8 import CpuGroupedInt8Weight
from heteroserve.platforms.cpu.packed import CpuPackedWeight
from heteroserve.platforms.operators import ExpertsFuser

# The projection formats the C++ kernels chain (csrc/projection.cpp), each as the tensors it takes: [panels] for
# packed float32 or bfloat16, [packed, scale_zero] for 4-bit, [q, scale(, zero)] for grouped 8-bit.
PROJECTION_FORMS: dict[type, Callable[..., list[torch.Tensor]]] = {
    CpuPackedWeight: lambda p: [p.packed],
    CpuInt4Weight: lambda p: [p.packed, p.scale_zero],
    CpuGroupedInt8Weight: lambda p: [p.weight.q, p.weight.scale, *([] if p.weight.zero is None else [p.weight.zero])],
}


class CpuFusedExperts:
    kernel_name = "cpp fused experts"

    def __init__(
        self,
        gate_up: list,
        down: list,
        first_expert: int,
        router: torch.Tensor,
        router_bias: torch.Tensor | None,
        spec: MoESpec,
        correction_bias: torch.Tensor | None,
    ) -> None:
        """gate_up, down: the local experts' projections as the linear op prepared them, in the forms
        projection_form takes; router: its float32 weight, packed here for the float32 GEMM (torch's product
        gives a row different bits at different row counts, which would let a batch change a token's experts'
        weights)."""
        self.router = torch.ops.heteroserve.pack_linear_weight(router.float())
        self.num_experts = router.shape[0]
        self.router_bias = None if router_bias is None else router_bias.float()
        self.routing = (
            spec.top_k,
            spec.scoring == "sigmoid",
            None if correction_bias is None else correction_bias.float().contiguous(),
            spec.num_groups,
            spec.top_groups,
            spec.group_score == "max",
            spec.renormalize,
            spec.routed_scale,
        )
        gate_up_tensors = [t for p in gate_up for t in PROJECTION_FORMS[type(p)](p)]
        down_tensors = [t for p in down for t in PROJECTION_FORMS[type(p)](p)]
        # Held once by the library: a call passes this object, not every expert's tensors.
        self.weights = torch.classes.heteroserve.ExpertWeights(
            gate_up_tensors,
            down_tensors,
            len(gate_up_tensors) // len(gate_up),
            len(down_tensors) // len(down),
            gate_up[0].shape[0],
            first_expert,
        )

    def route(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.ops.heteroserve.moe_route(h, *self.router_arguments())

    def router_arguments(self) -> tuple:
        """moe_route's arguments after the hidden states (decode_moe_layer takes them in the same order)."""
        return (self.router, self.num_experts, self.router_bias, *self.routing)

    def __call__(self, h: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return torch.ops.heteroserve.moe_experts(h, ids, weights, self.weights)


def projection_form(projection: object, dtype: torch.dtype) -> tuple | None:
    """What distinguishes a projection's form for the kernel (None: a form it does not take with `dtype`
    activations): float32 activations with float32 panels, 4-bit, or grouped 8-bit in groups of a multiple of 16;
    bfloat16 activations with bfloat16 panels."""
    if isinstance(projection, CpuPackedWeight):
        return ("panels",) if projection.packed.dtype == dtype and not projection.float_output else None
    if dtype != torch.float32:
        return None
    if isinstance(projection, CpuInt4Weight):
        return ("int4",)
    if isinstance(projection, CpuGroupedInt8Weight) and projection.weight.group_size % 16 == 0:
        return ("int8", projection.weight.zero is None)
    return None


def fuse_experts(
    gate_up: list,
    down: list,
    activation: str,
    first_expert: int,
    router: torch.Tensor,
    router_bias: torch.Tensor | None,
    spec: MoESpec,
    correction_bias: torch.Tensor | None,
    *,
    dtype: torch.dtype,
) -> CpuFusedExperts | None:
    """For an operator table of `dtype` activations (the platform binds it): experts with SiLU-gated MLPs whose
    projections all take one form each (all gate/up alike, all down alike) that the kernel reads at that dtype;
    others (8-bit per channel, act-order, other activations, a mixture of forms) run expert by expert, as do
    experts with biases (the caller does not offer them)."""
    if activation != "silu" or not gate_up:
        return None
    for projections in (gate_up, down):
        forms = {projection_form(p, dtype) for p in projections}
        if len(forms) != 1 or None in forms:
            return None
    return CpuFusedExperts(gate_up, down, first_expert, router, router_bias, spec, correction_bias)


def experts_fuser(dtype: torch.dtype) -> ExpertsFuser:
    fuser = functools.partial(fuse_experts, dtype=dtype)
    fuser.kernel_name = CpuFusedExperts.kernel_name
    return fuser
