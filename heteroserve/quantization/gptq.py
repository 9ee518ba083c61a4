"""GPTQ checkpoints as AutoGPTQ and GPTQModel write them (safetensors), read into our compressed weights.

Per quantised linear `W` [N out, K in] with `bits` in {4, 8}, `group_size` g (-1: one group per row, g = K),
p = 32 / bits values per int32 word:
- `qweight` int32 [K / p, N]: packed along the input dimension; word [r, n] holds W's integers at columns
  r * p .. r * p + p - 1 of row n, the first in the lowest bits.
- `qzeros`  int32 [K / g, N / p]: zero points packed along the output dimension the same way.
  Format "gptq" (AutoGPTQ, GPTQModel's default on disk) stores zero - 1; "gptq_v2" stores the zero itself.
- `scales`  float16 [K / g, N].
- `g_idx`   int32 [K]: the group of each input column; k // g unless act-order (`desc_act`) reordered them.
- w[n, k] = scales[g_idx[k], n] * (q[k, n] - zero[g_idx[k], n]); symmetric checkpoints store zero = 2**(bits-1).
Sources: AutoGPTQ `auto_gptq/nn_modules/qlinear/qlinear_cuda_old.py` (`QuantLinear.pack`, which subtracts 1
from the zeros, and `forward`, which adds it back), GPTQModel's `gptq_v2` conversion, and vLLM's
`model_executor/layers/quantization/gptq.py` (shapes of the four tensors).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from heteroserve.quantization.act_order import PermutedInput
from heteroserve.quantization.int4 import Int4Weight
from heteroserve.quantization.int8 import Int8Weight
from heteroserve.quantization.packed_int32 import unpack_int32

GPTQ_BITS = (4, 8)


@dataclass(frozen=True)
class GptqConfig:
    bits: int
    group_size: int  # -1: per output channel
    desc_act: bool = False
    sym: bool = True
    checkpoint_format: str = "gptq"  # or "gptq_v2"

    def __post_init__(self) -> None:
        if self.bits not in GPTQ_BITS:
            raise ValueError(f"GPTQ with {self.bits} bits is not supported (supported: {GPTQ_BITS})")
        if self.group_size != -1 and self.group_size <= 0:
            raise ValueError(f"GPTQ group_size must be positive or -1, got {self.group_size}")
        if self.checkpoint_format not in ("gptq", "gptq_v2"):
            raise ValueError(f"GPTQ checkpoint_format {self.checkpoint_format!r} is not supported (gptq, gptq_v2)")

    @classmethod
    def from_dict(cls, config: dict) -> GptqConfig:
        return cls(
            bits=int(config.get("bits", 4)),
            group_size=int(config.get("group_size", 128)),
            desc_act=bool(config.get("desc_act", False)),
            sym=bool(config.get("sym", True)),
            checkpoint_format=str(config.get("checkpoint_format", "gptq")),
        )

    @property
    def tensor_suffixes(self) -> tuple[str, ...]:
        return ("qweight", "qzeros", "scales", "g_idx")

    @property
    def required_suffixes(self) -> tuple[str, ...]:
        return ("qweight", "qzeros", "scales")


def gptq_weight(
    name: str, parts: dict[str, torch.Tensor], config: GptqConfig
) -> Int4Weight | Int8Weight | PermutedInput:
    """The linear `name` (its `qweight`, `qzeros`, `scales` and optional `g_idx`) as a compressed weight."""
    qweight, qzeros, scales = parts["qweight"], parts["qzeros"], parts["scales"]
    bits, per_word = config.bits, 32 // config.bits
    k, n = qweight.shape[0] * per_word, qweight.shape[1]
    if qweight.dtype != torch.int32 or qzeros.dtype != torch.int32:
        raise ValueError(f"{name}: GPTQ qweight/qzeros must be int32, got {qweight.dtype}/{qzeros.dtype}")
    if qzeros.shape[1] * per_word != n or scales.shape[1] != n:
        raise ValueError(
            f"{name}: qweight {tuple(qweight.shape)}, qzeros {tuple(qzeros.shape)} and scales {tuple(scales.shape)} "
            f"do not fit {bits}-bit GPTQ (the config says bits={bits}; is that the checkpoint's bit width?)"
        )
    group = k if config.group_size == -1 else min(config.group_size, k)  # a group wider than the row is the row
    if k % group:
        raise ValueError(f"{name}: {k} input columns are not a multiple of group_size {group} (unsupported)")
    groups = k // group
    if scales.shape[0] != groups or qzeros.shape[0] != groups:
        raise ValueError(
            f"{name}: {scales.shape[0]} scale groups for {k} input columns do not fit group_size {config.group_size}"
        )
    q = unpack_int32(qweight, bits, dim=0).t()  # [N, K]
    zero_q = unpack_int32(qzeros, bits, dim=1).t().float()  # [N, G]
    if config.checkpoint_format == "gptq":
        zero_q = zero_q + 1  # stored as zero - 1; like AutoGPTQ's kernels, a stored 2**bits - 1 reads as 2**bits
    scale = scales.float().t().contiguous()  # [N, G]
    g_idx = parts.get("g_idx")
    expected = torch.arange(k) // group
    order = None
    if g_idx is not None and not torch.equal(g_idx.long(), expected):
        order = torch.argsort(g_idx.long(), stable=True)
        if not torch.equal(g_idx.long()[order], expected):
            raise ValueError(f"{name}: g_idx does not assign {group} input columns to each of {groups} groups")
        q = q[:, order]
    if bits == 4:
        weight = Int4Weight.from_values(q, scale, scale * (8 - zero_q), group)
    else:
        zero = None if bool((zero_q == 128).all()) else scale * (128 - zero_q)
        weight = Int8Weight((q - 128).to(torch.int8).contiguous(), scale, group, zero)
    return weight if order is None else PermutedInput(weight, order)
