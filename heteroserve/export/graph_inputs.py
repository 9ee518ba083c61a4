"""The names, example tensors and dynamic axes of a graph's inputs and outputs, for one layout and shape set.

The exporter traces the module with these examples; sizes that are not static become named dynamic axes. Example
sizes are distinct and above 1 so that tracing neither specialises an axis nor mistakes two axes for one.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch
from torch.export import Dim

from heteroserve.model.arch import ModelArch

# Example sizes of the dynamic axes while tracing.
_EXAMPLE = {"batch": 2, "seq": 3, "blocks": 5, "max_blocks": 4, "cache_len": 7}


@dataclass(frozen=True)
class GraphShapes:
    """The axes of one graph: an int is static, a str names a dynamic axis."""

    batch: int | str
    seq: int | str
    blocks: int | str  # the paged cache's blocks (unused by the contiguous layout)
    max_blocks: int | str  # block-table width (paged) ...
    cache_len: int | str  # ... or cached tokens per sequence (contiguous)


def graph_shapes(static: dict[str, int], decode: bool, max_model_len: int, block_size: int) -> GraphShapes:
    """With any static size asked for, the cache's length axes are fixed at max_model_len too (the compilers that
    need one static shape need them all); a decode graph has one row per sequence."""
    fixed = bool(static)
    seq = 1 if decode else static.get("seq", "seq")
    return GraphShapes(
        batch=static.get("batch", "batch"),
        seq=seq,
        blocks=static.get("blocks", "num_blocks"),
        max_blocks=-(-max_model_len // block_size) if fixed else "max_blocks",
        cache_len=max_model_len if fixed else "cache_len",
    )


def _size(axis: int | str, example: str) -> int:
    return axis if isinstance(axis, int) else _EXAMPLE[example]


@cache
def _dim(name: str) -> Dim:
    """One Dim per name: inputs that share an axis name share the symbol."""
    return Dim(name, min=1)


def _dims(*axes: int | str) -> dict[int, Dim]:
    return {i: _dim(axis) for i, axis in enumerate(axes) if isinstance(axis, str)}


def input_names(arch: ModelArch, layout: str) -> list[str]:
    caches = [f"past_{kind}.{i}" for i in range(arch.num_layers) for kind in ("key", "value")]
    return ["input_ids", "positions", "seq_lens", *caches, *(["slot_mapping", "block_tables"] * (layout == "paged"))]


def output_names(arch: ModelArch) -> list[str]:
    return ["logits", *[f"present_{kind}.{i}" for i in range(arch.num_layers) for kind in ("key", "value")]]


def example_inputs(
    arch: ModelArch, layout: str, shapes: GraphShapes, block_size: int, cache_dtype: torch.dtype
) -> tuple[tuple, tuple]:
    """(example args of GraphDecoder.forward, their dynamic shapes): every token of every sequence attends."""
    b, s = _size(shapes.batch, "batch"), _size(shapes.seq, "seq")
    heads, dim = arch.num_kv_heads, arch.head_dim
    ids = torch.zeros((b, s), dtype=torch.long)
    positions = torch.arange(s).repeat(b, 1)
    seq_lens = torch.full((b,), s, dtype=torch.long)
    rows = _dims(shapes.batch, shapes.seq)
    if layout == "paged":
        width = _size(shapes.max_blocks, "max_blocks")
        num_blocks = max(_size(shapes.blocks, "blocks"), 1)
        cache = (num_blocks, block_size, heads, dim)
        tables = torch.arange(b * width).reshape(b, width) % num_blocks
        slots = tables[:, :1] * block_size + positions % block_size  # any valid slots: only shapes matter
        caches = [torch.zeros(cache, dtype=cache_dtype) for _ in range(2 * arch.num_layers)]
        cache_dims = [_dims(shapes.blocks)] * len(caches)
        args = (ids, positions, seq_lens, caches, slots, tables)
        return args, (rows, rows, _dims(shapes.batch), cache_dims, rows, _dims(shapes.batch, shapes.max_blocks))
    length = _size(shapes.cache_len, "cache_len")
    caches = [torch.zeros((b, length, heads, dim), dtype=cache_dtype) for _ in range(2 * arch.num_layers)]
    cache_dims = [_dims(shapes.batch, shapes.cache_len)] * len(caches)
    return (ids, positions, seq_lens, caches), (rows, rows, _dims(shapes.batch), cache_dims)
