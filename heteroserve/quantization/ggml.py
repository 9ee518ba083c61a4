"""GGML block formats (as llama.cpp's ggml-common.h defines them) read into our compressed weights without
going through float. Each row of a tensor is a run of blocks; all scales are float16 unless stated.

- Q4_0 (32 weights, 18 bytes): d, 16 bytes of nibbles; w = d (q - 8).
- Q4_1 (32, 20): d, m, nibbles; w = d q + m.
  In both, byte j of the nibbles holds weight j (low nibble) and weight j + 16 (high nibble).
- Q5_0 (32, 22): d, 4 bytes qh, 16 bytes nibbles; q = nibble | bit j of qh << 4; w = d (q - 16).
- Q5_1 (32, 24): d, m, qh, nibbles; w = d q + m.
- Q8_0 (32, 34): d, 32 int8; w = d q.
- Q4_K (256, 144): d, dmin, 12 bytes of 6-bit sub-block scales and mins (8 of each), 128 bytes of nibbles.
  Sub-block s (32 weights) has scale d sc[s] and min dmin m[s]: w = d sc q - dmin m. Nibble byte j of chunk c
  (32 bytes) holds sub-block 2c (low) and 2c + 1 (high) at position j.
- Q5_K (256, 176): like Q4_K plus 32 bytes qh before the nibbles: bit s of qh[j] is the fifth bit of
  sub-block s's weight j.
- Q6_K (256, 210): 128 bytes low nibbles, 64 bytes high 2-bit pairs, 16 int8 scales, d; w = d sc[i // 16] (q - 32).
  Half h (128 weights) reads ql[64 h: 64 h + 64] (low nibbles for its first 64 weights, high for the next 64)
  and qh[32 h: 32 h + 32] (bits 2t..2t+1 of byte j: weight 32 t + j of the half).

4-bit types become Int4Weight (torch's packed int4 kernel reads them); the rest become Int8Weight (one signed
byte a weight plus scales and zeros). Cross-checked against the `gguf` package's dequantisation in the tests.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType as T

from heteroserve.quantization.int4 import Int4Weight
from heteroserve.quantization.int8 import Int8Weight

BLOCK_BYTES = {T.Q4_0: 18, T.Q4_1: 20, T.Q5_0: 22, T.Q5_1: 24, T.Q8_0: 34, T.Q4_K: 144, T.Q5_K: 176, T.Q6_K: 210}
INT4_TYPES = (T.Q4_0, T.Q4_1, T.Q4_K)


def _f16(raw: np.ndarray) -> np.ndarray:
    return raw.copy().view(np.float16)[..., 0].astype(np.float32)


def _nibbles(raw: np.ndarray) -> np.ndarray:
    """[..., B] bytes -> [..., 2 B]: all low nibbles, then all high nibbles."""
    return np.concatenate([raw & 15, raw >> 4], axis=-1)


def _k_scales(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 bytes -> 8 six-bit scales and 8 six-bit mins. Bytes 0-3 hold scales 0-3 (and the top
    bits of scales 4-7), bytes 4-7 mins 0-3 (top bits of mins 4-7), bytes 8-11 the low nibbles of 4-7."""
    a, b, c = raw[..., 0:4], raw[..., 4:8], raw[..., 8:12]
    scales = np.concatenate([a & 63, (c & 15) | ((a >> 6) << 4)], axis=-1)
    mins = np.concatenate([b & 63, (c >> 4) | ((b >> 6) << 4)], axis=-1)
    return scales.astype(np.float32), mins.astype(np.float32)


def _high_bits(qh: np.ndarray, count: int) -> np.ndarray:
    """[..., 4] bytes -> [..., 32] bits, weight j from bit j (little-endian)."""
    return np.unpackbits(qh, axis=-1, bitorder="little")[..., :count]


def _decode(qtype: T, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, int]:
    """blocks [rows, B, bytes] -> (integers [rows, K], scale [rows, G], zero [rows, G] or None, group size)
    with w = (q - offset) * scale + zero for Int4 (offset 8) and w = q * scale + zero for Int8 (signed q)."""
    rows = blocks.shape[0]
    if qtype in (T.Q4_0, T.Q4_1):
        d = _f16(blocks[..., 0:2])
        if qtype == T.Q4_0:
            return _nibbles(blocks[..., 2:]).reshape(rows, -1), d, np.zeros_like(d), 32
        return _nibbles(blocks[..., 4:]).reshape(rows, -1), d, _f16(blocks[..., 2:4]) + 8 * d, 32
    if qtype in (T.Q5_0, T.Q5_1):
        d = _f16(blocks[..., 0:2])
        start = 2 if qtype == T.Q5_0 else 4
        q = _nibbles(blocks[..., start + 4 :]) | (_high_bits(blocks[..., start : start + 4], 32) << 4)
        signed = (q.astype(np.int16) - 16).reshape(rows, -1)
        zero = None if qtype == T.Q5_0 else _f16(blocks[..., 2:4]) + 16 * d
        return signed, d, zero, 32
    if qtype == T.Q8_0:
        return blocks[..., 2:].copy().view(np.int8).reshape(rows, -1), _f16(blocks[..., 0:2]), None, 32
    if qtype in (T.Q4_K, T.Q5_K):
        d, dmin = _f16(blocks[..., 0:2])[..., None], _f16(blocks[..., 2:4])[..., None]
        sc, mn = _k_scales(blocks[..., 4:16])
        scale, low = (d * sc).reshape(rows, -1), (dmin * mn).reshape(rows, -1)  # per 32-weight sub-block
        if qtype == T.Q4_K:
            q = _nibbles(blocks[..., 16:].reshape(rows, -1, 4, 32)).reshape(rows, -1)
            return q, scale, 8 * scale - low, 32
        qh = blocks[..., 16:48]  # [rows, B, 32]: bit s of byte j -> sub-block s, weight j
        high = np.unpackbits(qh[..., None], axis=-1, bitorder="little").transpose(0, 1, 3, 2)  # [rows, B, 8, 32]
        q = _nibbles(blocks[..., 48:].reshape(rows, -1, 4, 32)).reshape(rows, -1, 8, 32) | (high << 4)
        return (q.astype(np.int16) - 16).reshape(rows, -1), scale, 16 * scale - low, 32
    if qtype == T.Q6_K:
        ql = blocks[..., 0:128].reshape(rows, -1, 2, 64)  # per half: 64 bytes
        qh = blocks[..., 128:192].reshape(rows, -1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8)[:, None]
        low = _nibbles(ql)  # [rows, B, 2, 128]
        q = low | ((qh & 3).reshape(rows, -1, 2, 128) << 4)
        scale = _f16(blocks[..., 208:210])[..., None] * blocks[..., 192:208].copy().view(np.int8)
        return (q.astype(np.int16) - 32).reshape(rows, -1), scale.reshape(rows, -1).astype(np.float32), None, 16
    raise ValueError(f"GGML type {qtype.name} has no compressed form here")


def ggml_weight(qtype: T, data: np.ndarray, rows: int) -> Int4Weight | Int8Weight:
    """A GGML tensor's raw bytes (`rows` rows) as an Int4Weight (Q4_0/Q4_1/Q4_K) or Int8Weight (the others)."""
    blocks = np.asarray(data, dtype=np.uint8).reshape(rows, -1, BLOCK_BYTES[qtype])
    q, scale, zero, group = _decode(qtype, blocks)
    scale_t = torch.from_numpy(np.ascontiguousarray(scale, dtype=np.float32))
    zero_t = None if zero is None else torch.from_numpy(np.ascontiguousarray(zero, dtype=np.float32))
    if qtype in INT4_TYPES:
        return Int4Weight.from_values(torch.from_numpy(np.ascontiguousarray(q)), scale_t, zero_t, group)
    return Int8Weight(torch.from_numpy(np.ascontiguousarray(q, dtype=np.int8)), scale_t, group, zero_t)
