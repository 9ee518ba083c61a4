"""MXFP4 expert stacks (gpt-oss checkpoints, OCP Microscaling FP4), dequantised at load.

A stack `X` is stored as `X_blocks` uint8 [experts, rows, K / 32, 16] (two FP4 E2M1 values a byte, the low nibble
first, 32 values a block) and `X_scales` uint8 [experts, rows, K / 32] (each block's power-of-two scale, E8M0: the
exponent plus 127). Dequantised, it is the stack as the bfloat16 checkpoints store it: input-major
[experts, K, rows] (CheckpointLayout.stacked_experts). The experts then take the model's dtype, or 4 or 8 bits
with `--quantization int4|int8` (no kernel here reads MXFP4 as it is).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

# FP4 E2M1: sign, 2 exponent bits, 1 mantissa bit.
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
BLOCK = 32


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """[..., K / 32, 16] bytes and [..., K / 32] scales -> float32 [..., K]."""
    if blocks.dtype != torch.uint8 or blocks.shape[-1] != BLOCK // 2 or blocks.shape[:-1] != scales.shape:
        raise ValueError(
            f"MXFP4 blocks {tuple(blocks.shape)} ({blocks.dtype}) and scales {tuple(scales.shape)} do not match: "
            "expected uint8 [..., K / 32, 16] and [..., K / 32]"
        )
    lut = torch.tensor(FP4_VALUES)
    values = torch.stack((lut[(blocks & 15).long()], lut[(blocks >> 4).long()]), dim=-1).flatten(-2)
    return torch.ldexp(values, scales.to(torch.int32)[..., None] - 127).flatten(-2)


def dequantize_stacks(tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Other tensors pass through; each `X_blocks` / `X_scales` pair becomes `X`, input-major. A stack missing
    its other half is an error naming it."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors:
        for part in ("blocks", "scales"):
            if name.endswith(f"_{part}"):
                stack = name.removesuffix(f"_{part}")
                pending.setdefault(stack, {})[part] = tensor
                if len(pending[stack]) == 2:
                    halves = pending.pop(stack)
                    yield stack, dequantize_mxfp4(halves["blocks"], halves["scales"]).transpose(1, 2).contiguous()
                break
        else:
            yield name, tensor
    if pending:
        stack, halves = next(iter(pending.items()))
        missing = "scales" if "blocks" in halves else "blocks"
        raise ValueError(f"MXFP4 checkpoint has {stack}_{next(iter(halves))} but no {stack}_{missing}")
