"""Which architecture traits and weight formats each decoder-layer path implements, and that the CPU fuser
refuses a layer with anything its C++ layer does not (the layer then runs operator by operator).

The operator-by-operator layer (heteroserve.model.decoder) implements every trait of model.arch.LayerSpec; the
fused one's numerics for the traits it accepts are checked in test_cpu_decode_layer.py. Every LayerSpec field
has a row in LAYER_TRAITS with the fuser's expected answer, so a new trait fails here until someone decides it."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
import torch

from heteroserve.model.arch import LayerSpec, MLASpec, MoESpec
from heteroserve.platforms.cpu.decode_layer import fuse_decode_layer
from heteroserve.platforms.cpu.int4 import CpuInt4Weight
from heteroserve.platforms.cpu.int8 import CpuGroupedInt8Weight, CpuInt8Weight
from heteroserve.platforms.cpu.moe_experts import CpuFusedExperts
from heteroserve.platforms.cpu.packed import CpuPackedWeight
from heteroserve.platforms.operators import DecodeLayerWeights
from heteroserve.quantization.act_order import PermutedInput
from heteroserve.quantization.int4 import Int4Weight
from heteroserve.quantization.int8 import Int8Weight

HIDDEN, HEADS, HEAD_DIM, POSITIONS = 64, 2, 32, 16


def _packed(n: int = HIDDEN, k: int = HIDDEN) -> CpuPackedWeight:
    """The fuser reads only the type and tensors, so no C++ packing is needed to ask it."""
    return CpuPackedWeight(torch.zeros(1, k, n), n)


def _int4() -> CpuInt4Weight:
    return CpuInt4Weight(torch.zeros(1, HIDDEN, 32, dtype=torch.uint8), torch.zeros(1, 2, 2, 64), 32)


def _int8() -> Int8Weight:
    return Int8Weight(torch.zeros(HIDDEN, HIDDEN, dtype=torch.int8), torch.ones(HIDDEN, 2), 32)


def _moe(shared: bool = False, gated: bool = False):
    """A mixture-of-experts layer whose routed experts the CPU fused (the fuser sees only their type)."""
    shared_weights = {"shared_gate_up": _packed(2 * HIDDEN), "shared_down": _packed()} if shared else {}
    return _trait(
        "moe",
        MoESpec(8, 2, HIDDEN),
        gate_up=None,
        down=None,
        experts=CpuFusedExperts.__new__(CpuFusedExperts),
        shared_gate=torch.ones(1, HIDDEN) if gated else None,
        **shared_weights,
    )


def _layer() -> DecodeLayerWeights:
    norm = torch.ones(HIDDEN)
    return DecodeLayerWeights(
        input_norm=norm,
        qk_norms=None,
        qkv=_packed(3 * HIDDEN),
        qkv_bias=None,
        o_proj=_packed(),
        post_norm=norm,
        gate_up=_packed(2 * HIDDEN),
        down=_packed(),
        eps=1e-6,
        num_heads=HEADS,
        scale=HEAD_DIM**-0.5,
        cos=torch.ones(POSITIONS, HEAD_DIM),
        sin=torch.zeros(POSITIONS, HEAD_DIM),
        traits={},
    )


def _projections(make: Callable[[], object]) -> Callable[[DecodeLayerWeights], DecodeLayerWeights]:
    return lambda w: dataclasses.replace(w, qkv=make(), o_proj=make(), gate_up=make(), down=make())


def _trait(name: str, value: object, **weights) -> Callable[[DecodeLayerWeights], DecodeLayerWeights]:
    return lambda w: dataclasses.replace(w, traits={name: value}, **weights)


# LayerSpec field -> (a layer with it, whether the CPU fused layer implements it).
LAYER_TRAITS: dict[str, tuple[Callable[[DecodeLayerWeights], DecodeLayerWeights], bool]] = {
    "qkv_bias": (_trait("qkv_bias", True, qkv_bias=torch.zeros(3 * HIDDEN)), True),
    "qk_norm": (_trait("qk_norm", "head", qk_norms=(torch.ones(HEAD_DIM), torch.ones(HEAD_DIM))), True),
    "sliding_window": (_trait("sliding_window", 4), True),
    "rotary": (_trait("rotary", "local"), True),
    "o_bias": (_trait("o_bias", True), False),
    "attn_softcap": (_trait("attn_softcap", 50.0), False),
    "attn_sinks": (_trait("attn_sinks", True), False),
    "pre_norms": (_trait("pre_norms", False, input_norm=None, post_norm=None), False),
    "output_norms": (_trait("output_norms", True), False),
    "activation": (_trait("activation", "gelu_tanh"), False),
    "mlp_bias": (_trait("mlp_bias", True), False),
    "residual_scale": (_trait("residual_scale", 0.5), False),
    "moe": (_trait("moe", MoESpec(8, 2, HIDDEN), gate_up=None, down=None), False),
    "mla": (_trait("mla", MLASpec(None, 32, 16, 8, 16), qkv=None), False),
}
# Other things a layer may have -> (how it gets it, whether the fused layer takes it).
TRAITS: dict[str, tuple[Callable[[DecodeLayerWeights], DecodeLayerWeights], bool]] = {
    "plain float32 layer": (lambda w: w, True),
    "q/k norm over all heads": (_trait("qk_norm", "projection", qk_norms=(torch.ones(HIDDEN),) * 2), False),
    "M-RoPE": (lambda w: dataclasses.replace(w, multimodal_rope=True), False),
    "tensor parallel": (lambda w: dataclasses.replace(w, tensor_parallel_size=2), False),
    "bfloat16 activations": (lambda w: dataclasses.replace(w, input_norm=w.input_norm.bfloat16()), False),
    "4-bit weights (torch layout)": (_projections(_int4), True),
    "4-bit weights (not repacked)": (
        _projections(lambda: Int4Weight.from_values(torch.zeros(HIDDEN, HIDDEN), *[torch.zeros(HIDDEN, 2)] * 2, 32)),
        False,
    ),
    "8-bit grouped weights": (_projections(lambda: CpuGroupedInt8Weight(_int8())), True),
    "8-bit per-channel weights": (_projections(lambda: CpuInt8Weight(_int8(), torch.ones(HIDDEN))), False),
    "act-order weights": (_projections(lambda: PermutedInput(_packed(), torch.arange(HIDDEN))), False),
    "experts fused, no shared expert": (_moe(), True),
    "experts fused, with an ungated shared expert": (_moe(shared=True), True),
    "experts fused, with a gated shared expert": (_moe(shared=True, gated=True), True),
    **{f"layer trait {name}": row for name, row in LAYER_TRAITS.items()},
}


@pytest.mark.parametrize("trait", list(TRAITS))
def test_cpu_fuser_takes_exactly_the_traits_it_implements(trait):
    give, fused = TRAITS[trait]
    assert (fuse_decode_layer(give(_layer())) is not None) == fused


def test_every_layer_trait_has_a_decided_answer():
    """A new LayerSpec field (a block some family uses) must be added to LAYER_TRAITS."""
    assert set(LAYER_TRAITS) == {f.name for f in dataclasses.fields(LayerSpec)}


def test_every_decode_layer_field_is_a_listed_trait():
    """A new field on DecodeLayerWeights (something the decoder hands the fuser) must be covered above."""
    covered = {"qkv_bias", "qk_norms", "traits", "multimodal_rope", "tensor_parallel_size", "experts"}
    weights_and_sizes = {"input_norm", "post_norm", "qkv", "o_proj", "gate_up", "down", "eps", "num_heads"}
    weights_and_sizes |= {"shared_gate_up", "shared_down", "shared_gate"}
    rotary = {"scale", "cos", "sin"}
    assert {f.name for f in dataclasses.fields(DecodeLayerWeights)} == covered | weights_and_sizes | rotary
