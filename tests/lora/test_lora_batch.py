"""LoRABatch on the torch reference of the lora_add operator against a per-row loop in float64: in-place spans,
padded gathers, consecutive and scattered slots (the CPU kernel: tests/platforms/test_cpu_lora_products.py)."""

from __future__ import annotations

import pytest
import torch

from heteroserve.lora.batch import LoRABatch
from heteroserve.lora.slots import LoRASlots
from heteroserve.model.arch import LayerSpec, ModelArch
from heteroserve.platforms.cpu.platform import CpuPlatform

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
    "segments",
    [
        [(0, 2, 0), (2, 4, 1), (4, 6, 2), (6, 8, 3)],  # every slot, equal runs: in place
        [(3, 6, 1), (6, 9, 2)],  # consecutive slots after base rows: in place, a view of the slots
        [(1, 4, 0), (4, 5, 2), (6, 8, 3)],  # scattered slots, unequal runs, a base row between: gathered
        [(0, 1, 1), (5, 6, 1), (9, 10, 3)],  # a slot in two runs, slots out of row order
    ],
)
def test_adds_each_rows_adapter_product(slots, segments):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(10, ARCH.hidden_size, generator=gen, dtype=torch.float64)
    y = torch.randn(10, slots.b_t["qkv"].shape[-1], generator=gen, dtype=torch.float64)
    expected = y.clone()
    for first, end, slot in segments:
        for row in range(first, end):
            expected[row] += x[row] @ slots.a_t["qkv"][1, slot] @ slots.b_t["qkv"][1, slot]
    ops = CpuPlatform().operator_table(torch.float64, "reference")
    batch = LoRABatch(slots, segments, ops, torch.float64, torch.device("cpu"))
    got = batch.add(y.clone(), x, 1, "qkv")
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)
