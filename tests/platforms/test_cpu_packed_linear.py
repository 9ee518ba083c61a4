"""The C++ packed GEMMs (cpu/packed.py) against float64 products: every tile and panel edge, biases, strided and
batched inputs, and that the CPU platform's float32 (and, on AVX512-BF16, bfloat16) models go through them."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from heteroserve.platforms.cpu import kernels as cpu_kernels
from heteroserve.platforms.cpu.packed import CpuPackedWeight, bfloat16_gemm_available
from heteroserve.platforms.cpu.platform import CpuPlatform
from heteroserve.quantization.int8 import quantize_int8

# (K, N): SmolLM2's projections, a last panel of 6 columns, a single output column, odd K
PROJECTIONS = [(576, 960), (1536, 576), (64, 70), (33, 1), (7, 100)]
# one row, tile edges (8 on AVX-512 is not a tile height: 12 is; 6 on AVX2), a decode batch, a prefill chunk
ROWS = [1, 2, 6, 7, 12, 13, 64, 300]


@pytest.fixture(scope="module", autouse=True)
def library():
    if not cpu_kernels.load_library():
        pytest.skip("the C++ kernels cannot be built here (see the warning logged by cpu_kernels)")


def _reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return torch.nn.functional.linear(x.double(), w.double(), None if b is None else b.double())


@pytest.mark.parametrize("k,n", PROJECTIONS)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_a_float64_product(rows, k, n, with_bias):
    gen = torch.Generator().manual_seed(rows * 1000 + n)
    x, w = torch.randn(rows, k, generator=gen), torch.randn(n, k, generator=gen)
    b = torch.randn(n, generator=gen) if with_bias else None
    y = CpuPackedWeight.pack(w).matmul(x, b)
    expected = _reference(x, w, b)
    assert y.shape == (rows, n) and y.dtype == torch.float32
    assert float((y.double() - expected).norm() / expected.norm()) < 1e-6


def test_strided_and_batched_inputs():
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(70, 64, generator=gen)
    packed = CpuPackedWeight.pack(w)
    wide = torch.randn(9, 128, generator=gen)
    strided = wide[:, ::2]  # a view with a column stride, as split() of a fused projection gives
    assert torch.allclose(packed.matmul(strided, None), strided @ w.T, atol=1e-4)
    batched = torch.randn(2, 5, 64, generator=gen)
    assert torch.allclose(packed.matmul(batched, None), batched @ w.T, atol=1e-4)
    assert packed.matmul(batched, None).shape == (2, 5, 70)


def test_packing_keeps_every_weight_and_pads_with_zeros():
    w = torch.randn(70, 33)
    packed = CpuPackedWeight.pack(w)
    assert packed.shape == (70, 33)
    assert torch.equal(packed.dequantize(), w)
    assert packed.nbytes == packed.packed.numel() * 4 and packed.packed.shape[0] * packed.packed.shape[2] >= 70
    assert float(packed.packed.transpose(1, 2).reshape(-1, 33)[70:].abs().sum()) == 0


def test_bad_inputs_are_errors():
    packed = CpuPackedWeight.pack(torch.randn(16, 32))
    with pytest.raises(RuntimeError, match="x has 31 features, the weight 32"):
        packed.matmul(torch.randn(2, 31), None)
    with pytest.raises(RuntimeError, match="float32 only"):
        torch.ops.heteroserve.packed_linear(torch.randn(2, 32, dtype=torch.bfloat16), packed.packed, 16, None)
    with pytest.raises(RuntimeError, match="bias must be float32"):
        packed.matmul(torch.randn(2, 32), torch.randn(15))


def test_float32_and_bfloat16_models_use_it():
    platform = CpuPlatform()
    linear = platform.linear_op(torch.float32)
    assert linear.name == "cpp packed gemm"
    assert isinstance(linear.prepare(torch.randn(8, 16)), CpuPackedWeight)
    assert isinstance(linear.prepare_lm_head(torch.randn(8, 16)), CpuPackedWeight)
    assert platform.linear_op(torch.float32, kernels="reference").name == "torch.linear"
    if torch.bfloat16 in platform.supported_dtypes():
        linear = platform.linear_op(torch.bfloat16)
        weight = linear.prepare(torch.randn(8, 16, dtype=torch.bfloat16))
        if bfloat16_gemm_available():
            assert linear.name == "cpp packed gemm"
            assert isinstance(weight, CpuPackedWeight) and weight.packed.dtype == torch.bfloat16
            assert linear.prepare_lm_head(torch.randn(8, 16, dtype=torch.bfloat16)).float_output  # float32 logits
            odd = torch.randn(8, 15, dtype=torch.bfloat16)  # K not in pairs: float32 panels, bfloat16 results
            odd_packed = linear.prepare(odd)
            assert isinstance(odd_packed, CpuPackedWeight) and odd_packed.packed.dtype == torch.float32
            x_odd = torch.randn(3, 15).bfloat16()
            expected = x_odd.float() @ odd.float().T
            torch.testing.assert_close(linear(x_odd, odd_packed).float(), expected, rtol=2**-7, atol=1e-2)
            # an 8-bit LM head multiplies in float32: float32 logits from bfloat16 activations
            head = linear.prepare_lm_head(quantize_int8(torch.randn(64, 32), group_size=32))
            assert isinstance(head, CpuPackedWeight) and head.packed.dtype == torch.float32
            x = torch.randn(3, 32).bfloat16()
            logits = linear(x, head)
            assert logits.dtype == torch.float32
            torch.testing.assert_close(logits, x.float() @ head.dequantize().T, rtol=1e-5, atol=1e-5)
        else:
            assert linear.name == "onednn-packed" and isinstance(weight, torch.Tensor)


BF16_ULP = 2.0**-7


@pytest.mark.skipif("not bfloat16_gemm_available()", reason="the C++ kernels cannot be built here")
@pytest.mark.parametrize("k,n", [(576, 960), (1536, 576), (64, 70), (2, 1), (34, 100)])
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("with_bias", [False, True])
def test_bfloat16_matches_a_float64_product_rounded_once(rows, k, n, with_bias):
    """Products of bfloat16 values are exact in float32, so the result is the float64 product, up to float32
    summation (at most K float32 roundings of the terms' magnitudes), rounded to bfloat16 once."""
    gen = torch.Generator().manual_seed(rows * 1000 + n)
    x, w = torch.randn(rows, k, generator=gen).bfloat16(), torch.randn(n, k, generator=gen).bfloat16()
    b = torch.randn(n, generator=gen).bfloat16() if with_bias else None
    packed = CpuPackedWeight.pack(w, torch.bfloat16)
    assert packed.shape == (n, k) and torch.equal(packed.dequantize(torch.bfloat16), w)
    y = packed.matmul(x, b)
    exact = _reference(x, w, b)
    assert y.shape == (rows, n) and y.dtype == torch.bfloat16
    summation = k * 2.0**-24 * _reference(x.abs(), w.abs(), None if b is None else b.abs())
    error = (y.double() - exact).abs()
    bound = BF16_ULP / 2 * (exact.abs() + summation) + summation
    assert (error <= bound).all(), float((error / bound).max())
    logits = dataclasses.replace(packed, float_output=True).matmul(x, b)  # an LM head's: not rounded
    assert logits.dtype == torch.float32 and bool(((logits.double() - exact).abs() <= summation).all())


@pytest.mark.skipif("not bfloat16_gemm_available()", reason="the C++ kernels cannot be built here")
def test_bfloat16_rows_are_the_same_alone_and_in_any_batch():
    """Each row's sums run in one order whatever the batch: a request's outputs do not depend on its neighbours."""
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(960, 576, generator=gen).bfloat16()
    packed = CpuPackedWeight.pack(w, torch.bfloat16)
    x = torch.randn(300, 576, generator=gen).bfloat16()
    batch = packed.matmul(x, None)
    for rows in (1, 5, 12, 13, 64):
        assert torch.equal(packed.matmul(x[:rows], None), batch[:rows])
    assert torch.equal(packed.matmul(x[7:8], None), batch[7:8])
