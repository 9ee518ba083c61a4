"""Which rows of a step run under which adapter slot, in the forms the `lora_add` operator's kernels read: the
segments (a C++ kernel walks them) and the batched form of the torch reference (Punica's segmented idea in
plain torch: every fused product costs two batched matrix products over [adapters, rows, in], whatever the mix of
requests, with no loop over requests or adapters)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LoRARows:
    segments: torch.Tensor  # int64 [S, 3] on the CPU: (first row, end row, slot) of each run of rows
    slot_range: tuple[int, int] | None  # the active slots when consecutive: a view of the stacked matrices
    slot_index: torch.Tensor | None  # else their indices, gathered per product
    # When every active slot has the same number of rows, laid out in slot order: [adapters * rows] used in place.
    span: tuple[int, int] | None
    gather: torch.Tensor | None  # else each slot's rows [adapters, longest], padding pointing at row 0
    mask: torch.Tensor | None  # [adapters, longest, 1]: 1 on real rows, 0 on padding

    @staticmethod
    def plan(segments: list[tuple[int, int, int]], dtype: torch.dtype, device: torch.device) -> LoRARows:
        """segments: (first row, end row, slot) of the step's rows under adapters, in row order."""
        rows_by_slot: dict[int, list[int]] = {}
        for first, end, slot in segments:
            rows_by_slot.setdefault(slot, []).extend(range(first, end))
        active = sorted(rows_by_slot)
        consecutive = active == list(range(active[0], active[-1] + 1))
        slot_range = (active[0], active[-1] + 1) if consecutive else None
        slot_index = None if consecutive else torch.tensor(active, device=device)
        table = torch.tensor(segments, dtype=torch.long)
        counts = {len(rows_by_slot[s]) for s in active}
        first = rows_by_slot[active[0]][0]
        in_place = list(range(first, first + len(active) * len(rows_by_slot[active[0]])))
        if len(counts) == 1 and [r for s in active for r in rows_by_slot[s]] == in_place:
            return LoRARows(table, slot_range, slot_index, (first, in_place[-1] + 1), None, None)
        longest = max(counts)
        gather = torch.zeros(len(active), longest, dtype=torch.long)
        mask = torch.zeros(len(active), longest, 1)
        for i, slot in enumerate(active):
            rows = rows_by_slot[slot]
            gather[i, : len(rows)] = torch.tensor(rows)
            mask[i, : len(rows)] = 1.0
        return LoRARows(table, slot_range, slot_index, None, gather.to(device), mask.to(device=device, dtype=dtype))
