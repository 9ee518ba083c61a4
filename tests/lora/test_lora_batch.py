"""LoRABatch against a per-row loop in float64: in-place spans, padded gathers, consecutive and scattered slots."""

from __future__ import annotations

import pytest
import torch

from heteroserve.lora.batch import LoRABatch
from heteroserve.lora.slots import LoRASlots
from heteroserve.model.arch import LayerSpec, ModelArch

ARCH = ModelArch("llama", 64, 32, 2, 4, 2, 8, 48, 1e-5, False, 128, (LayerSpec(),) * 2, {}, 8**-0.5)


@pytest.fixture(scope="module")
def slots() -> LoRASlots:
    slots = LoRASlots(ARCH, 4, 4, torch.float64, torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    for name in slots.a_t:
        slots.a_t[name].copy_(torch.randn(slots.a_t[name].shape, generator=gen, dtype=torch.float64))
        slots.b_t[name].copy_(torch.randn(slots.b_t[name].shape, generator=gen, dtype=torch.float64))
    return slots


@pytest.mark.parametrize(
    "rows_by_slot",
    [
        {0: [0, 1], 1: [2, 3], 2: [4, 5], 3: [6, 7]},  # every slot, equal runs: in place
        {1: [3, 4, 5], 2: [6, 7, 8]},  # consecutive slots after base rows: in place, a view of the slots
        {0: [1, 2, 3], 2: [4], 3: [6, 7]},  # scattered slots, unequal runs, a base row between: gathered
        {3: [9], 1: [0, 5]},  # out of order
    ],
)
def test_adds_each_rows_adapter_product(slots, rows_by_slot):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(10, ARCH.hidden_size, generator=gen, dtype=torch.float64)
    y = torch.randn(10, slots.b_t["qkv"].shape[-1], generator=gen, dtype=torch.float64)
    expected = y.clone()
    for slot, rows in rows_by_slot.items():
        for row in rows:
            expected[row] += x[row] @ slots.a_t["qkv"][1, slot] @ slots.b_t["qkv"][1, slot]
    batch = LoRABatch(slots, rows_by_slot, torch.float64, torch.device("cpu"))
    got = batch.add(y.clone(), x, 1, "qkv")
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)
