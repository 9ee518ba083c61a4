"""The adapters resident on the device: `max_loras` slots of stacked matrices per layer and fused product, so a
step gathers its adapters' matrices by slot index instead of walking a per-adapter list."""

from __future__ import annotations

from collections import OrderedDict

import torch

from heteroserve.lora.peft_adapter import AdapterWeights
from heteroserve.lora.targets import fused_targets
from heteroserve.model.arch import ModelArch


class LoRASlots:
    """For each fused product (qkv, o, gate_up, down): A^T as [layers, slots, in, R] and B^T as
    [layers, slots, R, out], R = max_lora_rank per PEFT sub-module. Sub-module i of a product owns rows
    [i * max_rank, i * max_rank + r) of R and its own output columns, so a q-only adapter adds nothing to k and v.
    Slots are reused least recently used first."""

    def __init__(self, arch: ModelArch, max_loras: int, max_rank: int, dtype: torch.dtype, device: torch.device):
        self.max_rank = max_rank
        self.targets = fused_targets(arch)
        layers = arch.num_layers
        self.a_t = {
            t.name: torch.zeros(layers, max_loras, t.in_features, max_rank * len(t.parts), dtype=dtype, device=device)
            for t in self.targets
        }
        self.b_t = {
            t.name: torch.zeros(layers, max_loras, max_rank * len(t.parts), t.out_features, dtype=dtype, device=device)
            for t in self.targets
        }
        self.num_slots = max_loras
        self._resident: OrderedDict[int, int] = OrderedDict()  # adapter id -> slot, least recently used first

    def lookup(self, adapter_id: int) -> int | None:
        """The adapter's slot if it is resident (marked as just used), else None."""
        slot = self._resident.get(adapter_id)
        if slot is not None:
            self._resident.move_to_end(adapter_id)
        return slot

    def place(self, adapter_id: int, weights: AdapterWeights, keep: set[int]) -> int:
        """Writes the adapter into a free slot, or over the least recently used adapter not in `keep` (the ones
        the current step needs)."""
        if len(self._resident) < self.num_slots:
            slot = len(self._resident)
        else:
            victim = next((a for a in self._resident if a not in keep), None)
            if victim is None:
                raise RuntimeError(f"a step needs more than max_loras={self.num_slots} adapters at once")
            slot = self._resident.pop(victim)
        self._write(slot, weights)
        self._resident[adapter_id] = slot
        return slot

    def _write(self, slot: int, weights: AdapterWeights) -> None:
        rank = weights.config.rank
        for target in self.targets:
            a_t, b_t = self.a_t[target.name][:, slot], self.b_t[target.name][:, slot]
            a_t.zero_()
            b_t.zero_()
            column = 0
            for i, (part, width) in enumerate(target.parts):
                rows = slice(i * self.max_rank, i * self.max_rank + rank)
                for layer, modules in enumerate(weights.layers):
                    if part in modules:
                        a, b = modules[part]
                        a_t[layer, :, rows] = a.t()
                        b_t[layer, rows, column : column + width] = b.t()
                column += width
