"""Which architecture traits and weight formats each decoder-layer path implements, and that the CPU fuser
refuses a layer with anything its C++ layer does not (the layer then runs operator by operator).

The operator-by-operator layer (heteroserve.model.decoder) implements every trait listed here; the fused
one's numerics for the traits it accepts are checked in test_cpu_decode_layer.py. A trait added to the
decoder belongs in this table, with the fuser's answer for it."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
import torch

from heteroserve.platforms.cpu_decode_layer import fuse_decode_layer
from heteroserve.platforms.cpu_int4 import CpuInt4Weight
from heteroserve.platforms.cpu_int8 import CpuGroupedInt8Weight, CpuInt8Weight
from heteroserve.platforms.cpu_packed import CpuPackedWeight
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
    )


def _projections(make: Callable[[], object]) -> Callable[[DecodeLayerWeights], DecodeLayerWeights]:
    return lambda w: dataclasses.replace(w, qkv=make(), o_proj=make(), gate_up=make(), down=make())


# trait -> (how a layer gets it, whether the CPU fused layer implements it).
TRAITS: dict[str, tuple[Callable[[DecodeLayerWeights], DecodeLayerWeights], bool]] = {
    "plain float32 layer": (lambda w: w, True),
    "qkv bias": (lambda w: dataclasses.replace(w, qkv_bias=torch.zeros(3 * HIDDEN)), True),
    "q/k norm": (lambda w: dataclasses.replace(w, qk_norms=(torch.ones(HEAD_DIM), torch.ones(HEAD_DIM))), True),
    "sliding window": (lambda w: dataclasses.replace(w, sliding_window=4), True),
    "M-RoPE": (lambda w: dataclasses.replace(w, multimodal_rope=True), False),
    "tensor parallel": (lambda w: dataclasses.replace(w, tensor_parallel_size=2), False),
    "bfloat16 activations": (lambda w: dataclasses.replace(w, input_norm=w.input_norm.bfloat16()), False),
    "4-bit weights (torch layout)": (_projections(_int4), True),
    "4-bit weights (not repacked)": (
        _projections(lambda: Int4Weight.from_values(torch.zeros(HIDDEN, HIDDEN), *[torch.zeros(HIDDEN, 2)] * 2, 32)),
        False,
    ),
    "8-bit grouped weights": (_projections(lambda: CpuGroupedInt8Weight(_int8())), False),
    "8-bit per-channel weights": (_projections(lambda: CpuInt8Weight(_int8(), torch.ones(HIDDEN))), False),
    "act-order weights": (_projections(lambda: PermutedInput(_packed(), torch.arange(HIDDEN))), False),
}


@pytest.mark.parametrize("trait", list(TRAITS))
def test_cpu_fuser_takes_exactly_the_traits_it_implements(trait):
    give, fused = TRAITS[trait]
    assert (fuse_decode_layer(give(_layer())) is not None) == fused


def test_every_decode_layer_field_is_a_listed_trait():
    """A new field on DecodeLayerWeights (a new trait the decoder hands the fuser) must be added to TRAITS."""
    covered = {"qkv_bias", "qk_norms", "sliding_window", "multimodal_rope", "tensor_parallel_size"}
    weights_and_sizes = {"input_norm", "post_norm", "qkv", "o_proj", "gate_up", "down", "eps", "num_heads"}
    rotary = {"scale", "cos", "sin"}
    assert {f.name for f in dataclasses.fields(DecodeLayerWeights)} == covered | weights_and_sizes | rotary
