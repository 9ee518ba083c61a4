"""The C++ packed float32 GEMM (cpu_packed.py) against float64 products: every tile and panel edge, biases,
strided and batched inputs, and that the CPU platform's float32 models go through it."""

from __future__ import annotations

import pytest
import torch

from heteroserve.platforms import cpu_kernels
from heteroserve.platforms.cpu import CpuPlatform
from heteroserve.platforms.cpu_packed import CpuPackedWeight

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
        packed.matmul(torch.randn(2, 32, dtype=torch.bfloat16), None)
    with pytest.raises(RuntimeError, match="bias must be float32"):
        packed.matmul(torch.randn(2, 32), torch.randn(15))


def test_float32_models_use_it_and_bfloat16_ones_keep_onednn():
    platform = CpuPlatform()
    linear = platform.linear_op(torch.float32)
    assert linear.name == "cpp packed gemm"
    assert isinstance(linear.prepare(torch.randn(8, 16)), CpuPackedWeight)
    assert isinstance(linear.prepare_lm_head(torch.randn(8, 16)), CpuPackedWeight)
    assert platform.linear_op(torch.float32, kernels="reference").name == "torch.linear"
    if torch.bfloat16 in platform.supported_dtypes():
        assert platform.linear_op(torch.bfloat16).name == "onednn-packed"
