"""The CPU's lora_add kernel (csrc/lora_products.cpp) against a per-row loop in float64: segments of several
slots, runs longer than a register tile, a base row between, widths that are not a whole number of vectors; each
row's result the same bits alone as in the batch; bfloat16 within its rounding."""

from __future__ import annotations

import pytest
import torch

from heteroserve.platforms.cpu import kernels as cpu_kernels
from heteroserve.platforms.lora_rows import LoRARows

SLOTS, K = 4, 72


@pytest.fixture(scope="module")
def kernel() -> cpu_kernels.LoRAProducts:
    if not cpu_kernels.load_library():
        pytest.skip("the C++ kernels cannot be built here (see the warning logged by cpu_kernels)")
    return cpu_kernels.kernels_for(torch.float32)["lora_add"]


def _problem(rank: int, n: int, rows: int, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(rank * 1000 + n)
    x = torch.randn(rows, K, generator=gen).to(dtype)
    y = torch.randn(rows, n, generator=gen).to(dtype)
    a_t = (torch.randn(SLOTS, K, rank, generator=gen) * 0.2).to(dtype)
    b_t = (torch.randn(SLOTS, rank, n, generator=gen) * 0.2).to(dtype)
    return x, y, a_t, b_t


def _expected(x, y, a_t, b_t, segments) -> torch.Tensor:
    expected = y.double()
    for first, end, slot in segments:
        for row in range(first, end):
            expected[row] += x[row].double() @ a_t[slot].double() @ b_t[slot].double()
    return expected


SEGMENTS = [(0, 3, 2), (4, 21, 0), (21, 22, 3), (22, 30, 0)]  # a base row (3), a run of 17: several tiles


@pytest.mark.parametrize("rank, n", [(16, 96), (48, 960), (8, 77), (5, 19), (64, 40)])
def test_adds_each_rows_adapter_product(kernel, rank, n):
    x, y, a_t, b_t = _problem(rank, n, 30, torch.float32)
    expected = _expected(x, y, a_t, b_t, SEGMENTS)
    rows = LoRARows.plan(SEGMENTS, torch.float32, torch.device("cpu"))
    got = kernel(y.clone(), x, a_t, b_t, rows)
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(got[3], y[3]), "a base row is not touched"


@pytest.mark.parametrize("rank, n", [(48, 960), (5, 19)])
def test_a_row_gets_the_same_bits_alone_and_batched(kernel, rank, n):
    x, y, a_t, b_t = _problem(rank, n, 30, torch.float32)
    batched = kernel(y.clone(), x, a_t, b_t, LoRARows.plan(SEGMENTS, torch.float32, torch.device("cpu")))
    for row, slot in [(0, 2), (9, 0), (21, 3), (29, 0)]:
        alone = kernel(
            y[row : row + 1].clone(),
            x[row : row + 1],
            a_t,
            b_t,
            LoRARows.plan([(0, 1, slot)], torch.float32, torch.device("cpu")),
        )
        assert torch.equal(alone[0], batched[row]), f"row {row}"


@pytest.mark.parametrize("weights", [torch.bfloat16, torch.float16])
def test_16bit_adapters_are_widened_as_they_are_read(kernel, weights):
    """--lora-dtype: float32 rows, 16-bit A^T and B^T; the same sums as float32 matrices holding the same values."""
    x, y, a_t, b_t = _problem(48, 960, 30, torch.float32)
    a_t, b_t = a_t.to(weights), b_t.to(weights)
    rows = LoRARows.plan(SEGMENTS, torch.float32, torch.device("cpu"))
    got = kernel(y.clone(), x, a_t, b_t, rows)
    assert torch.equal(got, kernel(y.clone(), x, a_t.float(), b_t.float(), rows))


def test_bfloat16_within_its_rounding(kernel):
    x, y, a_t, b_t = _problem(16, 96, 30, torch.bfloat16)
    expected = _expected(x, y, a_t, b_t, SEGMENTS)
    got = kernel(y.clone(), x, a_t, b_t, LoRARows.plan(SEGMENTS, torch.bfloat16, torch.device("cpu")))
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), expected, rtol=2e-2, atol=2e-2)


def test_a_strided_output_is_written_in_place(kernel):
    x, y, a_t, b_t = _problem(16, 96, 30, torch.float32)
    wide = torch.zeros(30, 200)
    wide[:, 50:146] = y
    view = wide[:, 50:146]
    kernel(view, x, a_t, b_t, LoRARows.plan(SEGMENTS, torch.float32, torch.device("cpu")))
    torch.testing.assert_close(view.double(), _expected(x, y, a_t, b_t, SEGMENTS), rtol=1e-5, atol=1e-5)
    assert not wide[:, :50].any() and not wide[:, 146:].any()
