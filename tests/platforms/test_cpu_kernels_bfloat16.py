"""The CPU kernels with bfloat16 activations against the torch reference in bfloat16 and against float32 over the
same bfloat16 values: each kernel computes in float32 and rounds its output once, so it must sit within bfloat16
rounding of the float32 result and be no further from it than the reference (which rounds after every step)."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from heteroserve.platforms import reference_ops
from heteroserve.platforms.cpu import kernels as cpu_kernels
from heteroserve.platforms.cpu.platform import CpuPlatform
from tests.platforms.test_cpu_kernels import prompt_chunk

BF16_ULP = 2.0**-7  # bfloat16 keeps 7 significand bits after the leading one: rounding once is within half of this


@pytest.fixture(scope="module")
def kernels() -> dict:
    if not cpu_kernels.load_library():
        pytest.skip("the C++ kernels cannot be built here (see the warning logged by cpu_kernels)")
    return cpu_kernels.kernels_for(torch.bfloat16)


def bf16_randn(*shape: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(torch.bfloat16)


def relative_error(y: torch.Tensor, exact: torch.Tensor) -> float:
    return float((y.double() - exact.double()).norm() / exact.double().norm())


def assert_rounded_once(out: torch.Tensor, exact: torch.Tensor, reference: torch.Tensor) -> None:
    """out is bfloat16 and each element within one rounding of the float32 result; over the whole tensor no
    further from it than the bfloat16 reference, which matches out to bfloat16's tolerance."""
    assert out.dtype == torch.bfloat16 and out.shape == exact.shape
    error = (out.double() - exact.double()).abs()
    assert (error <= BF16_ULP / 2 * exact.double().abs() + 1e-6).all(), float(error.max())
    assert relative_error(out, exact) <= relative_error(reference, exact) + 1e-4
    torch.testing.assert_close(out.float(), reference.float(), rtol=2 * BF16_ULP, atol=2 * BF16_ULP)


@pytest.mark.parametrize("rows,hidden", [(1, 576), (7, 960), (64, 576), (300, 33), (5, 1)])
def test_rms_norm(kernels, rows, hidden):
    gen = torch.Generator().manual_seed(rows * hidden)
    x, weight = bf16_randn(rows, hidden, gen=gen), bf16_randn(hidden, gen=gen)
    exact = reference_ops.rms_norm(x.float(), weight.float(), 1e-5)
    assert_rounded_once(kernels["rms_norm"](x, weight, 1e-5), exact, reference_ops.rms_norm(x, weight, 1e-5))


def test_rms_norm_on_strided_head_views(kernels):
    """Qwen3's q/k norms: [T, heads, D] views of the fused projection."""
    gen = torch.Generator().manual_seed(0)
    heads, weight = bf16_randn(9, 8, 64, gen=gen)[:, ::2], bf16_randn(64, gen=gen)
    exact = reference_ops.rms_norm(heads.float(), weight.float(), 1e-6)
    assert_rounded_once(kernels["rms_norm"](heads, weight, 1e-6), exact, reference_ops.rms_norm(heads, weight, 1e-6))


@pytest.mark.parametrize("rows,intermediate", [(1, 1536), (7, 2560), (64, 1536), (3, 17)])
def test_silu_and_mul(kernels, rows, intermediate):
    gen = torch.Generator().manual_seed(rows + intermediate)
    gate_up = (4 * torch.randn(rows, 2 * intermediate, generator=gen)).to(torch.bfloat16)  # |gate| both sides of 0
    exact = reference_ops.silu_and_mul(gate_up.float())
    assert_rounded_once(kernels["silu_and_mul"](gate_up), exact, reference_ops.silu_and_mul(gate_up))


@pytest.mark.parametrize("rows,head_dim", [(1, 64), (64, 64), (300, 64), (5, 18), (3, 128)])
def test_rotary_on_views_of_the_fused_projection(kernels, rows, head_dim):
    """bfloat16 q, k over the model's float32 cos/sin tables (the reference rounds the tables to bfloat16)."""
    gen = torch.Generator().manual_seed(rows * head_dim)
    qkv = bf16_randn(rows, (9 + 2 * 3) * head_dim, gen=gen)
    q, k, _ = qkv.split([9 * head_dim, 3 * head_dim, 3 * head_dim], dim=-1)
    q, k = q.view(rows, 9, head_dim), k.view(rows, 3, head_dim)
    angles = torch.rand(2048, head_dim, generator=gen) * 6.3
    cos, sin = angles.cos(), angles.sin()
    positions = torch.randint(0, 2048, (rows,), generator=gen)
    ours = kernels["rotary"](positions, q, k, cos, sin)
    exact = reference_ops.rotary(positions, q.float(), k.float(), cos, sin)
    for out, expected, reference in zip(ours, exact, reference_ops.rotary(positions, q, k, cos, sin), strict=True):
        assert out.dtype == torch.bfloat16 and out.shape == expected.shape
        error = (out.double() - expected.double()).abs()
        assert (error <= BF16_ULP / 2 * expected.double().abs() + 1e-6).all()
        assert relative_error(out, expected) < relative_error(reference, expected)
        assert relative_error(out, reference) < 2 * BF16_ULP


@pytest.mark.parametrize("num_heads,num_kv_heads", [(9, 3), (8, 2)])
@pytest.mark.parametrize("head_dim", [32, 64, 128])
@pytest.mark.parametrize(
    "num_queries,context,window", [(1, 1, None), (13, 13, None), (128, 128, None), (37, 100, None), (50, 300, 64)]
)
def test_prefill_attention(kernels, num_queries, context, window, head_dim, num_heads, num_kv_heads):
    """Whole prompts, chunks after a cached prefix, a sliding window; odd row counts (partial query tiles)."""
    q, keys, values, mask, scale = prompt_chunk(
        num_queries, context, num_heads, num_kv_heads, head_dim, window, seed=num_queries + head_dim
    )
    q, keys, values = (t.to(torch.bfloat16) for t in (q, keys, values))
    out = kernels["prefill_attention"](q, keys, values, mask, scale)
    exact = reference_ops.prefill_attention(q.float(), keys.float(), values.float(), mask, scale)
    assert out.dtype == torch.bfloat16 and out.shape == exact.shape
    assert relative_error(out, exact) < BF16_ULP / 2
    reference = _torch_bfloat16_attention(q, keys, values, mask, scale)
    assert relative_error(out, exact) <= relative_error(reference, exact) + 1e-4
    torch.testing.assert_close(out.float(), reference.float(), rtol=4 * BF16_ULP, atol=4 * BF16_ULP)


def _torch_bfloat16_attention(q, keys, values, mask, scale) -> torch.Tensor:
    """torch's attention in bfloat16. On a CPU with AMX whose torch dispatch is held below AVX-512 (the level tests'
    $ATEN_CPU_CAPABILITY), torch's flash kernel packs for AMX and refuses ("pack_vnni2 is only supported when avx512
    is supported"): there its math kernel, also bfloat16, is the reference."""
    try:
        return reference_ops.prefill_attention(q, keys, values, mask, scale)
    except RuntimeError as exc:
        if "pack_vnni2" not in str(exc):
            raise
    with sdpa_kernel(SDPBackend.MATH):
        return reference_ops.prefill_attention(q, keys, values, mask, scale)


@pytest.mark.parametrize("length", [1, 13, 128])
def test_bidirectional_attention(kernels, length):
    gen = torch.Generator().manual_seed(length)
    q, keys, values = bf16_randn(length, 3, 4, 64, gen=gen).unbind(1)
    out = kernels["bidirectional_attention"](q, keys, values, 64**-0.5)
    exact = reference_ops.bidirectional_attention(q.float(), keys.float(), values.float(), 64**-0.5)
    assert out.dtype == torch.bfloat16 and relative_error(out, exact) < BF16_ULP / 2


@pytest.mark.parametrize("rows,vocab", [(1, 1), (1, 49152), (3, 17), (64, 49152), (5, 151937)])
def test_argmax_rows_is_torch_max_indices(kernels, rows, vocab):
    """bfloat16 logits tie often: the first maximum wins, as in torch; a NaN row gives its first NaN."""
    gen = torch.Generator().manual_seed(rows + vocab)
    x = bf16_randn(rows, vocab, gen=gen)
    x[0, vocab - 1] = x[0].max() + 1  # the maximum in the tail after the last whole vector
    if rows > 1:
        x[1] = x[1].max()
    if rows > 2:
        x[2, [vocab // 3, vocab - 2]] = float("nan")
    if rows > 3:
        x[3] = float("-inf")
    if rows > 4:
        x[4, [7, 3, vocab - 1]] = x[4].max() + 1
    got = kernels["argmax_rows"](x)
    assert got.dtype == torch.long
    assert got.tolist() == reference_ops.argmax_rows(x).tolist() == x.float().max(dim=-1).indices.tolist()


def test_the_operator_table_runs_every_bfloat16_operator_natively(kernels):
    """The table picks the C++ kernel for each operator with bfloat16 activations, and none of them falls back."""
    platform = CpuPlatform()
    table = platform.operator_table(torch.bfloat16)
    described = table.describe()
    native = {
        "rms_norm",
        "silu_and_mul",
        "rotary",
        "prefill_attention",
        "bidirectional_attention",
        "argmax_rows",
        "decode_attention",
    }
    assert native <= set(kernels)
    assert {name: described[name] for name in native} == {name: kernels[name].kernel_name for name in native}
    gen = torch.Generator().manual_seed(0)
    x = bf16_randn(3, 64, gen=gen)
    table.rms_norm(x, bf16_randn(64, gen=gen), 1e-6)
    table.silu_and_mul(x)
    q, k = bf16_randn(3, 4, 64, gen=gen), bf16_randn(3, 2, 64, gen=gen)
    table.rotary(torch.tensor([0, 1, 2]), q, k, torch.randn(8, 64), torch.randn(8, 64))
    table.prefill_attention(q, k, k, None, 0.125)
    table.bidirectional_attention(q, q, q, 0.125)
    table.argmax_rows(x)
    assert platform.operator_fallbacks == {}
