"""What an export asks for, validated once: layout, dtype, static shapes, opset, where to write.

Imports no torch, so that the `heteroserve` command's parser can offer these choices without loading it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

DTYPES = ("float32", "float16", "bfloat16")
KV_LAYOUTS = ("paged", "contiguous")  # export/kv_layout.py's PagedKV and ContiguousKV
# --static keys: the batch of both graphs, the prefill graph's rows per sequence, the paged cache's blocks.
STATIC_KEYS = ("batch", "seq", "blocks")
# How 4-bit projection weights are stored: dense in the export's dtype (every runtime), or compressed as
# onnxruntime's MatMulNBits contrib op (onnxruntime only).
INT4_WEIGHTS = ("dequantize", "matmulnbits")


def parse_static(text: str | None) -> dict[str, int]:
    """`batch=8,seq=512` -> {"batch": 8, "seq": 512}; errors name --static and the bad part."""
    if not text:
        return {}
    shapes: dict[str, int] = {}
    for part in text.split(","):
        key, sep, value = part.strip().partition("=")
        if not sep or key not in STATIC_KEYS:
            raise ValueError(f"--static: {part!r} is not KEY=SIZE with KEY one of {', '.join(STATIC_KEYS)}")
        if not value.isdigit() or int(value) < 1:
            raise ValueError(f"--static: {key} must be a positive integer, got {value!r}")
        shapes[key] = int(value)
    return shapes


def parse_grid(text: str) -> tuple[int, int, int]:
    """`1,16,16` -> (temporal, height, width) in patches; errors name --vision-grid."""
    parts = text.split(",")
    if len(parts) != 3 or not all(p.strip().isdigit() and int(p) > 0 for p in parts):
        raise ValueError(f"--vision-grid takes T,H,W (patches, positive integers), got {text!r}")
    t, h, w = (int(p) for p in parts)
    return t, h, w


@dataclass(frozen=True)
class ExportOptions:
    out: Path
    dtype: str = "float32"  # or "auto", which export_onnx resolves against the loaded checkpoint
    kv_layout: str = "paged"
    static: dict[str, int] = field(default_factory=dict)  # fixed sizes; the other axes stay dynamic
    block_size: int = 16
    max_model_len: int | None = None  # None: the model's own context length
    opset: int = 18
    int4_weights: str = "dequantize"
    vision_grid: tuple[int, int, int] | None = None  # a VL model's vision tower as its own graph for this grid

    def __post_init__(self) -> None:
        if self.dtype not in ("auto", *DTYPES):
            raise ValueError(f"--dtype must be auto or one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.kv_layout not in KV_LAYOUTS:
            raise ValueError(f"--kv-layout must be one of {', '.join(KV_LAYOUTS)}, got {self.kv_layout!r}")
        unknown = set(self.static) - set(STATIC_KEYS)
        if unknown:
            raise ValueError(f"--static: unknown keys {', '.join(sorted(unknown))} (known: {', '.join(STATIC_KEYS)})")
        if "blocks" in self.static and self.kv_layout != "paged":
            raise ValueError("--static blocks=N sizes the paged cache; --kv-layout contiguous has no blocks")
        if self.block_size < 1:
            raise ValueError(f"--block-size must be >= 1, got {self.block_size}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"--max-model-len must be >= 1, got {self.max_model_len}")
        if self.int4_weights not in INT4_WEIGHTS:
            raise ValueError(f"--int4-weights must be one of {', '.join(INT4_WEIGHTS)}, got {self.int4_weights!r}")
        if self.int4_weights == "matmulnbits" and self.dtype == "bfloat16":
            raise ValueError("--int4-weights matmulnbits takes float32 or float16 scales, not --dtype bfloat16")
        if not 18 <= self.opset <= 23:
            raise ValueError(f"--opset must be between 18 and 23 (the dynamo exporter's range), got {self.opset}")

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch

        if self.dtype == "auto":
            raise ValueError("dtype auto is resolved against the checkpoint first (onnx_export.resolve_dtype)")
        return getattr(torch, self.dtype)
