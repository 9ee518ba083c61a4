"""A step's rows that run under adapters, and their adapter products added to the base model's.

Punica's segmented idea in plain torch: each active adapter's rows are gathered into one padded batch
([adapters, rows, in]), so every fused product of every layer costs two batched matrix products whatever the mix
of requests, with no loop over requests or adapters. Rows of the base model are not touched."""

from __future__ import annotations

import torch

from heteroserve.lora.slots import LoRASlots


class LoRABatch:
    def __init__(
        self, slots: LoRASlots, rows_by_slot: dict[int, list[int]], dtype: torch.dtype, device: torch.device
    ) -> None:
        """rows_by_slot: resident slot -> the step's (flattened) rows under that adapter."""
        self.slots = slots
        active = sorted(rows_by_slot)
        longest = max(len(rows) for rows in rows_by_slot.values())
        gather = torch.zeros(len(active), longest, dtype=torch.long)
        mask = torch.zeros(len(active), longest, 1)
        for i, slot in enumerate(active):
            rows = rows_by_slot[slot]
            gather[i, : len(rows)] = torch.tensor(rows)
            mask[i, : len(rows)] = 1.0
        self.gather = gather.to(device)
        self.targets = self.gather.flatten()  # padding rows point at row 0 and add zeros there
        self.mask = mask.to(device=device, dtype=dtype)
        # Every slot active, in order: the stacked matrices are used as they are, without a gather.
        self.slot_index = None if active == list(range(slots.num_slots)) else torch.tensor(active, device=device)

    def add(self, y: torch.Tensor, x: torch.Tensor, layer: int, target: str) -> torch.Tensor:
        """y + the adapters' x A^T B^T on their rows, for the fused product `target` of decoder layer `layer`."""
        a_t, b_t = self.slots.a_t[target][layer], self.slots.b_t[target][layer]
        if self.slot_index is not None:
            a_t, b_t = a_t.index_select(0, self.slot_index), b_t.index_select(0, self.slot_index)
        low = torch.bmm(x[self.gather], a_t) * self.mask
        return y.index_add_(0, self.targets, torch.bmm(low, b_t).flatten(0, 1))
