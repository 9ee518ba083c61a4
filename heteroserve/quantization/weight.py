"""The protocol every compressed weight implements, so that code which multiplies, measures or shards a weight
never asks which format it is.

A format (Int4Weight, Int8Weight, a platform's packed form of one) carries its own reference product, its
expansion to a dense tensor, its stored size and, where tensor parallelism may split it, its slicing. A platform
that has a faster kernel for a format repacks the weight into a type of its own at load (`LinearOp.prepare`)
whose `matmul` runs that kernel; the linear op then calls `weight.matmul` whatever the type, so a vendor adds a
kernel for a format without editing our dispatch (vLLM's `LinearMethodBase` plays this part there).
"""

from __future__ import annotations

import dataclasses
from typing import Protocol, TypeVar, runtime_checkable

import torch


@runtime_checkable
class CompressedWeight(Protocol):
    """A projection weight [N, K] kept in a form other than a dense tensor."""

    @property
    def shape(self) -> tuple[int, int]: ...

    @property
    def nbytes(self) -> int:
        """Bytes as stored (the compressed size)."""
        ...

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The dense [N, K] weight in `dtype`, in the checkpoint's column order."""
        ...

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x W^T + b, with x [T, K]."""
        ...

    def to(self, device: torch.device) -> CompressedWeight:
        """The same weight with every tensor it holds on `device` (the loader places each weight where the
        platform computes, before the platform's packer sees it)."""
        ...


@runtime_checkable
class ShardableWeight(CompressedWeight, Protocol):
    """A compressed weight that tensor parallelism can split (heteroserve.model.sharding)."""

    def slice_rows(self, start: int, end: int) -> ShardableWeight:
        """Output rows [start, end), copied so that the whole weight can be freed."""
        ...

    def slice_columns(self, start: int, end: int) -> ShardableWeight:
        """Input columns [start, end); a ValueError saying why where the format cannot split there."""
        ...


Moved = TypeVar("Moved")


def move_tensors(weight: Moved, device: torch.device) -> Moved:
    """A dataclass weight with each of its tensors (and nested weights) on `device`: every format's `to`."""
    changes = {}
    for field in dataclasses.fields(weight):
        value = getattr(weight, field.name)
        if isinstance(value, torch.Tensor) or (dataclasses.is_dataclass(value) and hasattr(value, "to")):
            changes[field.name] = value.to(device)
    return dataclasses.replace(weight, **changes)


def kept_on(weight: Moved, home: torch.device, device: torch.device) -> Moved:
    """`to` of a platform's packed form, which only that platform's kernels read: it stays where it is."""
    if torch.device(device).type != home.type:
        raise ValueError(f"{type(weight).__name__} is laid out for {home.type} kernels and cannot move to {device}")
    return weight
