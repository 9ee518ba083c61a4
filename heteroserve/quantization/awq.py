"""AWQ checkpoints in the GEMM format (AutoAWQ's `WQLinear_GEMM`, llm-awq), read into our int4 weight.

Per quantised linear `W` [N out, K in], 4 bits, group size g:
- `qweight` int32 [K, N / 8]: packed along the output dimension, 8 values a word, but interleaved: the value
  in bits [4 i, 4 i + 4) of word c is output column 8 c + AWQ_ORDER[i] with AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7].
- `qzeros`  int32 [K / g, N / 8]: zero points, packed the same way (no offset, unlike GPTQ's "zero - 1").
- `scales`  float16 [K / g, N].
- w[n, k] = scales[k // g, n] * (q[k, n] - zero[k // g, n]).
Sources: AutoAWQ `awq/modules/linear/gemm.py` (`WQLinear_GEMM.from_linear` packs with that order) and vLLM's
`model_executor/layers/quantization/awq_triton.py` (reads it back with the inverse order [0, 4, 1, 5, 2, 6, 3, 7]).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from heteroserve.quantization.int4 import Int4Weight
from heteroserve.quantization.packed_int32 import unpack_int32

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # slot i of a word holds column AWQ_ORDER[i] of its 8


@dataclass(frozen=True)
class AwqConfig:
    bits: int = 4
    group_size: int = 128
    zero_point: bool = True
    version: str = "gemm"

    def __post_init__(self) -> None:
        if self.bits != 4:
            raise ValueError(f"AWQ with {self.bits} bits is not supported (only 4)")
        if self.version.lower() != "gemm":
            raise ValueError(f"AWQ version {self.version!r} is not supported (only the GEMM format)")
        if not self.zero_point:
            raise ValueError("AWQ without zero points is not supported")
        if self.group_size <= 0:
            raise ValueError(f"AWQ group_size must be positive, got {self.group_size}")

    @classmethod
    def from_dict(cls, config: dict) -> AwqConfig:
        return cls(
            bits=int(config.get("bits", config.get("w_bit", 4))),
            group_size=int(config.get("group_size", config.get("q_group_size", 128))),
            zero_point=bool(config.get("zero_point", True)),
            version=str(config.get("version", "gemm")),
        )

    @property
    def tensor_suffixes(self) -> tuple[str, ...]:
        return ("qweight", "qzeros", "scales")

    required_suffixes = tensor_suffixes


def _unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """[R, C] words -> [R, 8 C] values in natural column order."""
    slots = unpack_int32(packed, 4, dim=1).view(packed.shape[0], -1, 8)
    natural = torch.empty_like(slots)
    natural[..., list(AWQ_ORDER)] = slots
    return natural.view(packed.shape[0], -1)


def awq_weight(name: str, parts: dict[str, torch.Tensor], config: AwqConfig) -> Int4Weight:
    qweight, qzeros, scales = parts["qweight"], parts["qzeros"], parts["scales"]
    k, n = qweight.shape[0], qweight.shape[1] * 8
    if qweight.dtype != torch.int32 or qzeros.dtype != torch.int32:
        raise ValueError(f"{name}: AWQ qweight/qzeros must be int32, got {qweight.dtype}/{qzeros.dtype}")
    groups = k // config.group_size
    if k % config.group_size or tuple(scales.shape) != (groups, n) or tuple(qzeros.shape) != (groups, n // 8):
        raise ValueError(
            f"{name}: qweight {tuple(qweight.shape)}, qzeros {tuple(qzeros.shape)} and scales {tuple(scales.shape)} "
            f"do not fit 4-bit AWQ with group_size {config.group_size}"
        )
    q = _unpack_awq(qweight).t()  # [N, K]
    zero_q = _unpack_awq(qzeros).t().float()  # [N, G]
    scale = scales.float().t().contiguous()
    return Int4Weight.from_values(q, scale, scale * (8 - zero_q), config.group_size)
