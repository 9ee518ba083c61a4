"""A step's rows that run under adapters, and their adapter products added to the base model's outputs.

The runner passes each request's slot and row count in row order; every fused product of every layer then adds
its adapters' products through the platform's `lora_add` operator (one call per product, whatever the mix of
requests). Rows of the base model are not touched."""

from __future__ import annotations

import torch

from heteroserve.lora.slots import LoRASlots
from heteroserve.platforms.lora_rows import LoRARows
from heteroserve.platforms.operators import OperatorTable


class LoRABatch:
    def __init__(
        self,
        slots: LoRASlots,
        segments: list[tuple[int, int, int]],
        ops: OperatorTable,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        """segments: (first row, end row, resident slot) of each request's rows under an adapter."""
        self.slots = slots
        self.ops = ops
        self.rows = LoRARows.plan(segments, dtype, device)

    def add(self, y: torch.Tensor, x: torch.Tensor, layer: int, target: str) -> torch.Tensor:
        """y + the adapters' x A^T B^T on their rows, for the fused product `target` of decoder layer `layer`."""
        return self.ops.lora_add(y, x, self.slots.a_t[target][layer], self.slots.b_t[target][layer], self.rows)

    def layer_matrices(self, layer: int) -> list[torch.Tensor]:
        """A^T and B^T of every slot for qkv, o, gate_up and down of decoder layer `layer` (the fused decode
        layer's order)."""
        return [
            m[target][layer] for target in ("qkv", "o", "gate_up", "down") for m in (self.slots.a_t, self.slots.b_t)
        ]
