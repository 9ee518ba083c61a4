"""Small integers packed into int32 words, as GPTQ and AWQ checkpoints store them: value i of a word sits in
bits [i * bits, (i + 1) * bits), least significant first."""

from __future__ import annotations

import torch


def unpack_int32(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 words -> their `32 // bits` values each (as int32, 0 .. 2**bits - 1), spread along `dim`."""
    if packed.dtype != torch.int32:
        raise ValueError(f"packed weights must be int32, got {packed.dtype}")
    per_word = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    if dim == 0:  # words [R, C] -> values [R * per_word, C]
        values = (packed[:, None, :] >> shifts[None, :, None]) & ((1 << bits) - 1)
        return values.reshape(packed.shape[0] * per_word, packed.shape[1])
    values = (packed[:, :, None] >> shifts[None, None, :]) & ((1 << bits) - 1)  # words [R, C] -> [R, C * per_word]
    return values.reshape(packed.shape[0], packed.shape[1] * per_word)
