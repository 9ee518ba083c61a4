"""A step's rows that run under adapters, and their adapter products added to the base model's.

Punica's segmented idea in plain torch: the runner orders a step's rows by adapter slot, so each adapter's rows
sit together; every fused product of every layer then costs two batched matrix products over [adapters, rows,
in], whatever the mix of requests, with no loop over requests or adapters. When every adapter has the same number
of rows in one run (a decode step of evenly spread requests) the rows are used in place; otherwise each adapter's
rows are gathered into a padded batch. Rows of the base model are not touched."""

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
        # The active slots' matrices: a view when they are consecutive slots, else gathered per product.
        self.slot_range = (active[0], active[-1] + 1) if active == list(range(active[0], active[-1] + 1)) else None
        self.slot_index = None if self.slot_range else torch.tensor(active, device=device)
        counts = {len(rows_by_slot[s]) for s in active}
        first = rows_by_slot[active[0]][0]
        in_place = list(range(first, first + len(active) * len(rows_by_slot[active[0]])))
        if len(counts) == 1 and [r for s in active for r in rows_by_slot[s]] == in_place:
            self.span = (first, in_place[-1] + 1)  # [adapters * rows] in slot order: reshaped, not gathered
            return
        self.span = None
        longest = max(counts)
        gather = torch.zeros(len(active), longest, dtype=torch.long)
        mask = torch.zeros(len(active), longest, 1)
        for i, slot in enumerate(active):
            rows = rows_by_slot[slot]
            gather[i, : len(rows)] = torch.tensor(rows)
            mask[i, : len(rows)] = 1.0
        self.gather = gather.to(device)
        self.targets = self.gather.flatten()  # padding rows point at row 0 and add zeros there
        self.mask = mask.to(device=device, dtype=dtype)

    def add(self, y: torch.Tensor, x: torch.Tensor, layer: int, target: str) -> torch.Tensor:
        """y + the adapters' x A^T B^T on their rows, for the fused product `target` of decoder layer `layer`."""
        a_t, b_t = self.slots.a_t[target][layer], self.slots.b_t[target][layer]
        if self.slot_range is not None:
            a_t, b_t = a_t[self.slot_range[0] : self.slot_range[1]], b_t[self.slot_range[0] : self.slot_range[1]]
        else:
            a_t, b_t = a_t.index_select(0, self.slot_index), b_t.index_select(0, self.slot_index)
        if self.span is not None:
            start, end = self.span
            rows = x[start:end].view(a_t.shape[0], -1, x.shape[1])
            y[start:end] += torch.bmm(torch.bmm(rows, a_t), b_t).flatten(0, 1)
            return y
        low = torch.bmm(x[self.gather], a_t) * self.mask
        return y.index_add_(0, self.targets, torch.bmm(low, b_t).flatten(0, 1))
