"""The CPU platform's C++ kernels against the torch reference: paged decode attention on caches laid out as the
engine does, and the fused element-wise operators on the shapes and views the model passes."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time

import pytest
import torch

from heteroserve.platforms import reference_ops
from heteroserve.platforms.attention import AttentionStep
from heteroserve.platforms.cpu import kernels as cpu_kernels
from heteroserve.platforms.cpu.platform import CpuPlatform
from heteroserve.platforms.operators import REFERENCE_LINEAR
from heteroserve.platforms.paged_attention import AttentionMetadata, PagedAttentionBackend

BLOCK_SIZE = 16
EDGE_LENGTHS = [1, 2, 15, 16, 17, 33, 140, 300]  # one token, block edges, the scenario-B length, many blocks


def paged_metadata(requests: list[tuple[list[int], int, int]], num_decodes: int, sliding_window) -> AttentionMetadata:
    """The paged backend's metadata for requests (block_ids, first new position, new tokens), decodes first."""
    step = AttentionStep.of(BLOCK_SIZE, requests, num_decodes, sliding_window, "cpu")
    return PagedAttentionBackend(CpuPlatform().operator_table(torch.float32, "reference")).build_metadata(step)


@pytest.fixture(scope="module")
def fused() -> dict:
    if not cpu_kernels.load_library():
        pytest.skip("the C++ kernels cannot be built here (see the warning logged by cpu_kernels)")
    return cpu_kernels.kernels_for(torch.float32)


@pytest.fixture(scope="module")
def kernel(fused) -> cpu_kernels.PagedDecodeAttention:
    return fused["decode_attention"]


def paged_batch(context_lengths, num_heads, num_kv_heads, head_dim, sliding_window=None, dtype=torch.float32, seed=0):
    """Random caches whose blocks are handed out in shuffled order, with spare blocks nobody owns, and the block
    tables and mask that the paged attention backend makes for these decodes."""
    gen = torch.Generator().manual_seed(seed)
    blocks_needed = [-(-n // BLOCK_SIZE) for n in context_lengths]
    num_blocks = sum(blocks_needed) + 5
    order = torch.randperm(num_blocks, generator=gen).tolist()
    decodes, start = [], 0
    for n, count in zip(context_lengths, blocks_needed, strict=True):
        decodes.append((order[start : start + count], n - 1, 1))  # the query is the last token of the context
        start += count
    meta = paged_metadata(decodes, len(decodes), sliding_window)
    shape = (num_blocks, BLOCK_SIZE, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    q = torch.randn(len(decodes), num_heads, head_dim, generator=gen).to(dtype)
    return q, k_cache, v_cache, meta.decode_block_tables, meta.decode_mask, head_dim**-0.5


def _relative_error(out: torch.Tensor, expected: torch.Tensor) -> float:
    return float((out.float() - expected.float()).norm() / expected.float().norm())


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (9, 3), (8, 2)])  # GQA groups 1, 3, 4
@pytest.mark.parametrize("head_dim", [32, 64, 128])
@pytest.mark.parametrize("batch", [1, 64])
def test_matches_the_reference(kernel, batch, head_dim, num_heads, num_kv_heads):
    gen = torch.Generator().manual_seed(batch * head_dim + num_heads)
    lengths = (EDGE_LENGTHS + torch.randint(1, 300, (batch,), generator=gen).tolist())[:batch]
    if batch == 1:
        lengths = [140]
    args = paged_batch(lengths, num_heads, num_kv_heads, head_dim)
    out, expected = kernel(*args), reference_ops.decode_attention(*args)
    assert out.shape == expected.shape and out.dtype == expected.dtype
    assert _relative_error(out, expected) < 1e-5
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_sliding_window_reads_only_the_window(kernel):
    lengths = [1, 5, 16, 20, 40, 100, 257]
    args = paged_batch(lengths, 9, 3, 64, sliding_window=16)
    torch.testing.assert_close(kernel(*args), reference_ops.decode_attention(*args), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("sharpness", [0.0, 8.0, 60.0])  # uniform, peaked, nearly one-hot softmax
def test_softmax_over_a_wide_range_of_scores(kernel, sharpness):
    q, k_cache, v_cache, tables, mask, scale = paged_batch(EDGE_LENGTHS, 9, 3, 64)
    out = kernel(q * sharpness, k_cache, v_cache, tables, mask, scale)
    # Against float64: scores of several hundred lose ~1e-5 to float32 rounding in any order of summation, so
    # the float32 reference is no yardstick at sharpness 60 (its own error was 1.9e-5 on an Intel Xeon, ours 1.0e-5).
    q64, k64, v64 = (q * sharpness).double(), k_cache.double(), v_cache.double()
    exact = reference_ops.decode_attention(q64, k64, v64, tables, mask, scale)
    float32 = reference_ops.decode_attention(q * sharpness, k_cache, v_cache, tables, mask, scale)
    torch.testing.assert_close(out.double(), exact, rtol=1e-5, atol=3e-5)
    assert (out.double() - exact).abs().max() <= (float32.double() - exact).abs().max() + 1e-6


def test_masked_tokens_are_never_read(kernel):
    """Table entries past a request's context may point anywhere; NaN there must not reach the output."""
    q, k_cache, v_cache, tables, mask, scale = paged_batch([3, 40], 9, 3, 64)
    in_use = mask[:, 0, 0, :].view(len(tables), -1, BLOCK_SIZE).any(-1)
    spare = sorted(set(range(k_cache.shape[0])) - set(tables[in_use].tolist()))
    assert (~in_use).any() and spare
    tables = tables.masked_fill(~in_use, spare[0])
    k_cache[spare], v_cache[spare] = float("nan"), float("nan")
    out = kernel(q, k_cache, v_cache, tables, mask, scale)
    assert not out.isnan().any()
    expected = reference_ops.decode_attention(q, k_cache.nan_to_num(), v_cache.nan_to_num(), tables, mask, scale)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_caches_accumulate_in_float32(kernel, dtype):
    q, k_cache, v_cache, tables, mask, scale = paged_batch(EDGE_LENGTHS, 9, 3, 64, dtype=dtype)
    out = kernel(q, k_cache, v_cache, tables, mask, scale)
    assert out.dtype == dtype
    expected = reference_ops.decode_attention(q.float(), k_cache.float(), v_cache.float(), tables, mask, scale)
    assert _relative_error(out, expected) < 1e-2  # the output's own rounding
    # float32 arithmetic inside, each output rounded once: within half a unit in the last place (plus a hair)
    ulp = 2.0**-7 if dtype == torch.bfloat16 else 2.0**-10
    error = (out.double() - expected.double()).abs()
    assert (error <= ulp / 2 * expected.double().abs() + 1e-5).all(), float(error.max())


@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [32, 64, 128])  # the generic loop; the vector path
@pytest.mark.parametrize("batch", [1, 64])
def test_float32_queries_over_a_16bit_cache(kernel, cache_dtype, head_dim, batch):
    """`--kv-cache-dtype float16|bfloat16`: the kernel widens the rows it reads; the result is the reference's over
    the same cache widened to float32, to float32 rounding."""
    lengths = (EDGE_LENGTHS * 8)[:batch]
    q, k_cache, v_cache, tables, mask, scale = paged_batch(lengths, 9, 3, head_dim)
    k_cache, v_cache = k_cache.to(cache_dtype), v_cache.to(cache_dtype)
    out = kernel(q, k_cache, v_cache, tables, mask, scale)
    assert out.dtype == torch.float32
    expected = reference_ops.decode_attention(q, k_cache, v_cache, tables, mask, scale)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("head_dim", [32, 64])  # the generic loop; the vector path
@pytest.mark.parametrize("sliding_window", [None, 24])
def test_draft_rows_sharing_a_block_table(kernel, cache_dtype, head_dim, sliding_window):
    """A speculative step: a request's decode token and drafts are consecutive rows with one block table, each
    attending to its own prefix (the kernel reads their blocks once for all of them). Each row must equal the
    reference's answer for that row alone."""
    gen = torch.Generator().manual_seed(head_dim)
    contexts, drafts = [1, 17, 40, 140, 9], [0, 3, 4, 2, 1]
    blocks_needed = [-(-(n + d) // BLOCK_SIZE) for n, d in zip(contexts, drafts, strict=True)]
    order = torch.randperm(sum(blocks_needed) + 3, generator=gen).tolist()
    decodes, start = [], 0
    for n, d, count in zip(contexts, drafts, blocks_needed, strict=True):
        decodes.append((order[start : start + count], n - 1, d + 1))  # rows at positions n-1 .. n-1+d, one table
        start += count
    meta = paged_metadata(decodes, len(decodes), sliding_window)
    shape = (len(order), BLOCK_SIZE, 3, head_dim)
    k_cache, v_cache = (torch.randn(shape, generator=gen).to(cache_dtype) for _ in range(2))
    q = torch.randn(meta.num_decodes, 9, head_dim, generator=gen)
    args = (q, k_cache, v_cache, meta.decode_block_tables, meta.decode_mask, head_dim**-0.5)
    torch.testing.assert_close(kernel(*args), reference_ops.decode_attention(*args), rtol=1e-5, atol=1e-5)


def test_float16_queries_over_a_float32_cache_are_an_error(kernel):
    q, k_cache, v_cache, tables, mask, scale = paged_batch([20], 9, 3, 64)
    with pytest.raises(RuntimeError, match="q float32 over a float16 or bfloat16 cache"):
        kernel(q.half(), k_cache, v_cache, tables, mask, scale)


@pytest.mark.parametrize("rows,vocab", [(1, 1), (1, 49152), (3, 17), (64, 49152), (5, 151936)])
def test_argmax_rows_is_torch_max_indices(fused, rows, vocab):
    """Greedy tokens: the first maximum of each row, ties and all; a row with a NaN gives its first NaN (as torch's
    max), an all -inf row its first entry."""
    gen = torch.Generator().manual_seed(rows * vocab)
    x = torch.randn(rows, vocab, generator=gen)
    x[:, vocab // 2 :] = x[:, vocab // 2 :].round(decimals=1)  # ties among the candidates
    x[0, vocab - 1] = x[0].max() + 1  # the maximum in the tail after the last whole vector
    if rows > 1:
        x[1] = x[1].max()  # every entry equal: index 0
    if rows > 2:
        x[2, [vocab // 3, vocab - 2]] = float("nan")
    if rows > 3:
        x[3] = float("-inf")
    if rows > 4:
        top = x[4].max() + 1
        x[4, [7, 3, vocab - 1]] = top  # ties for the maximum: the first
    got = fused["argmax_rows"](x)
    assert got.dtype == torch.long
    assert got.tolist() == reference_ops.argmax_rows(x).tolist() == x.max(dim=-1).indices.tolist()


def test_bad_block_id_is_an_error_not_a_crash(kernel):
    q, k_cache, v_cache, tables, mask, scale = paged_batch([20], 9, 3, 64)
    tables = tables.clone()
    tables[0, 1] = k_cache.shape[0]
    with pytest.raises(RuntimeError, match="out of range"):
        kernel(q, k_cache, v_cache, tables, mask, scale)


def test_cpu_platform_runs_its_operators_through_the_kernels(fused):
    platform = CpuPlatform()
    described = platform.operator_table(torch.float32).describe()
    assert {name: described[name] for name in fused} == {name: k.kernel_name for name, k in fused.items()}
    assert described["write_kv"] == "torch reference"
    reference = platform.operator_table(torch.float32, kernels="reference").describe()
    assert {reference[name] for name in fused} == {"torch reference"}
    # float16 activations: the attention kernel, the reference element-wise operators
    fp16 = platform.operator_table(torch.float16).describe()
    assert fp16["decode_attention"] == fused["decode_attention"].kernel_name and fp16["rms_norm"] == "torch reference"


def prompt_chunk(num_queries, context, num_heads, num_kv_heads, head_dim, sliding_window=None, seed=0):
    """q, keys, values (strided views) and mask of a prompt chunk as the paged attention backend makes them: the
    chunk's queries sit after `context - num_queries` cached tokens; the mask is None for a whole prompt without
    a window."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(num_queries, num_heads + 1, head_dim, generator=gen)[:, 1:]  # views, as split from qkv
    keys, values = torch.randn(context, 2 * num_kv_heads, head_dim, generator=gen).split(num_kv_heads, dim=1)
    blocks = list(range(-(-context // BLOCK_SIZE)))
    meta = paged_metadata([(blocks, context - num_queries, num_queries)], 0, sliding_window)
    return q, keys, values, meta.prefills[0].mask, head_dim**-0.5


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (9, 3), (8, 2)])
@pytest.mark.parametrize("head_dim", [32, 64, 128])
@pytest.mark.parametrize(
    "num_queries,context,window",
    [(1, 1, None), (13, 13, None), (128, 128, None), (300, 300, None), (37, 100, None), (50, 300, 64), (90, 90, 32)],
)
def test_prefill_attention_matches_the_reference(
    fused, num_queries, context, window, head_dim, num_heads, num_kv_heads
):
    """Whole prompts (causal, no mask), chunks after a cached prefix, sliding windows; row counts that are not a
    whole number of the kernel's query tiles."""
    args = prompt_chunk(num_queries, context, num_heads, num_kv_heads, head_dim, window, seed=num_queries + head_dim)
    out, expected = fused["prefill_attention"](*args), reference_ops.prefill_attention(*args)
    assert out.shape == expected.shape
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("head_dim", [16, 32, 64, 128])
@pytest.mark.parametrize("length", [1, 13, 128, 300])
def test_bidirectional_attention_matches_the_reference(fused, length, head_dim):
    """An encoder's sequence: every query sees every key (the first rows see the last keys, unlike causal); views of
    a fused qkv projection, as the encoder passes them. Head size 16 is off the tile and keeps the reference."""
    gen = torch.Generator().manual_seed(length + head_dim)
    q, keys, values = torch.randn(length, 3, 4, head_dim, generator=gen).unbind(1)
    out = fused["bidirectional_attention"](q, keys, values, head_dim**-0.5)
    expected = reference_ops.bidirectional_attention(q, keys, values, head_dim**-0.5)
    causal = reference_ops.prefill_attention(q, keys, values, None, head_dim**-0.5)
    if length > 1:
        assert (expected - causal).abs().max() > 0.1  # the check below tells bidirectional from causal
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_prefill_attention_keeps_the_reference_for_head_sizes_off_the_tile(fused):
    """Head sizes that are not a whole number of the tile's panels (32 columns with AVX-512) go to SDPA."""
    panel = torch.ops.heteroserve.pack_linear_weight(torch.zeros(1, 1)).shape[-1]
    for head_dim in (8, 24, 48, 64, 80):
        assert torch.ops.heteroserve.prefill_attention_supports(head_dim) == (head_dim % panel == 0)
        args = prompt_chunk(20, 20, 4, 2, head_dim)
        torch.testing.assert_close(
            fused["prefill_attention"](*args), reference_ops.prefill_attention(*args), rtol=1e-5, atol=1e-5
        )
    q, keys, values, _, scale = prompt_chunk(5, 9, 4, 2, 64)
    with pytest.raises(RuntimeError, match="without a mask the chunk must be all the keys"):
        torch.ops.heteroserve.prefill_attention(q, keys, values, None, scale)


def relative_error(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y - ref).norm() / ref.norm())


@pytest.mark.parametrize("rows", [1, 7, 64, 300])
def test_fused_rms_norm_and_silu_and_mul(fused, rows):
    gen = torch.Generator().manual_seed(rows)
    x, weight = torch.randn(rows, 576, generator=gen), torch.randn(576, generator=gen)
    assert relative_error(fused["rms_norm"](x, weight, 1e-5), reference_ops.rms_norm(x, weight, 1e-5)) < 1e-6
    heads = torch.randn(rows, 8, 64, generator=gen)[:, ::2]  # a strided [T, heads, D] view (Qwen3's q/k norms)
    assert (
        relative_error(fused["rms_norm"](heads, weight[:64], 1e-6), reference_ops.rms_norm(heads, weight[:64], 1e-6))
        < 1e-6
    )
    gate_up = 6 * torch.randn(rows, 2 * 1536, generator=gen)  # large |gate| on both sides of 0
    assert relative_error(fused["silu_and_mul"](gate_up), reference_ops.silu_and_mul(gate_up)) < 1e-6


@pytest.mark.parametrize("rows", [1, 64, 300])
def test_fused_rotary_on_views_of_the_fused_projection(fused, rows):
    gen = torch.Generator().manual_seed(rows)
    qkv = torch.randn(rows, (9 + 2 * 3) * 64, generator=gen)
    q, k, _ = qkv.split([9 * 64, 3 * 64, 3 * 64], dim=-1)
    q, k = q.view(rows, 9, 64), k.view(rows, 3, 64)
    cos, sin = torch.randn(2048, 64, generator=gen), torch.randn(2048, 64, generator=gen)
    positions = torch.randint(0, 2048, (rows,), generator=gen)
    ours, expected = fused["rotary"](positions, q, k, cos, sin), reference_ops.rotary(positions, q, k, cos, sin)
    for a, b in zip(ours, expected, strict=True):
        assert a.shape == b.shape and relative_error(a, b) < 1e-6
    with pytest.raises(RuntimeError, match="outside the table"):
        fused["rotary"](torch.full((rows,), 2048), q, k, cos, sin)


def test_fused_operators_say_not_implemented_for_other_dtypes(fused):
    x = torch.randn(4, 64, dtype=torch.float16)
    with pytest.raises(NotImplementedError, match="float32 or bfloat16 only"):
        fused["rms_norm"](x, torch.ones(64, dtype=torch.float16), 1e-5)


def test_build_directory_is_keyed_by_cpu_torch_and_source(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    here = cpu_kernels.build_directory()
    assert here.parent == tmp_path
    monkeypatch.setattr(cpu_kernels, "cpu_flags", lambda: "x86_64 avx2")
    assert cpu_kernels.build_directory() != here


def test_build_directory_with_a_left_behind_lock_still_loads(fused, tmp_path):
    """A process killed inside torch's build step leaves `lock` in the build directory; a built library is then
    loaded without waiting on it (before, every later engine start waited forever)."""
    lock = cpu_kernels.build_directory() / "lock"
    lock.touch()
    try:
        script = "from heteroserve.platforms.cpu import kernels; print(kernels.load_library())"
        result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
        assert result.stdout.strip() == "True", result.stderr
    finally:
        lock.unlink(missing_ok=True)


def test_build_directory_stale_lock_is_removed_before_a_build(tmp_path):
    lock = tmp_path / "lock"
    lock.touch()
    cpu_kernels._remove_stale_lock(tmp_path)
    assert lock.exists(), "a fresh lock belongs to a build in progress"
    old = time.time() - cpu_kernels.STALE_LOCK_SECONDS - 60
    os.utime(lock, (old, old))
    cpu_kernels._remove_stale_lock(tmp_path)
    assert not lock.exists()


def test_other_dtypes_say_not_implemented(kernel):
    """NotImplementedError is what the operator table turns into a reference fallback."""
    args = paged_batch([20], 9, 3, 64, dtype=torch.float64)
    with pytest.raises(NotImplementedError, match="float32, bfloat16 and float16"):
        kernel(*args)


def test_a_failed_build_warns_once_and_keeps_the_reference(monkeypatch, tmp_path, caplog):
    broken = tmp_path / "broken.cpp"
    broken.write_text("this is not C++\n")
    monkeypatch.setattr(cpu_kernels, "SOURCES", [broken])
    monkeypatch.delenv("HETEROSERVE_CPU_LEVEL", raising=False)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "extensions"))
    monkeypatch.setenv("HETEROSERVE_PREBUILT_KERNELS", str(tmp_path / "prebuilt"))
    cpu_kernels.load_library.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="heteroserve.platforms.cpu.kernels"):
            table = CpuPlatform().operator_table(torch.float32)
            CpuPlatform().operator_table(torch.float32)
        described = table.describe()
        formats = {name: described.pop(name) for name in list(described) if name.startswith("linear ")}
        assert set(described.values()) == {
            "onednn-packed",
            "torch reference",
            "operator by operator",
            "expert by expert",
        }
        assert formats["linear int4"] == f"{REFERENCE_LINEAR}: the C++ kernels are not loaded"
        messages = [r.getMessage() for r in caplog.records]
        assert len(messages) == 1 and messages[0].startswith(
            "the CPU C++ kernels could not be loaded (building for this CPU failed"
        )
    finally:
        cpu_kernels.load_library.cache_clear()
