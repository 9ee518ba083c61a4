"""Attention backends against the numerics baseline: paged attention over the reference operators.

One mixed step (decodes, a decode with drafts, a whole prompt, a chunk after a cached prefix) on a cache whose
blocks are handed out in shuffled order; every backend must write the same cache and return the same rows."""

from __future__ import annotations

import functools
import importlib.util
import sys

import pytest
import torch

from heteroserve.platforms.attention import AttentionBackend, AttentionStep
from heteroserve.platforms.cpu.platform import CpuPlatform
from heteroserve.platforms.interface import Platform
from heteroserve.platforms.paged_attention import PagedAttentionBackend
from tests.platforms.plugin_site import PLUGIN

BLOCK_SIZE = 8
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 6, 2, 16
# (tokens cached before the step, new tokens, is a decode request)
REQUESTS = [(5, 1, True), (16, 1, True), (20, 4, True), (0, 11, False), (13, 7, False)]


@functools.cache
def _example_plugin():
    """The example plugin's module, imported from its file (the plugin test installs it in a fresh interpreter)."""
    name = "heteroserve_counting_platform"
    spec = importlib.util.spec_from_file_location(name, PLUGIN / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclasses resolve their annotations through it
    spec.loader.exec_module(module)
    return module


def _reference() -> PagedAttentionBackend:
    return PagedAttentionBackend(CpuPlatform().operator_table(torch.float32, "reference"))


def _mixed_step(sliding_window: int | None, cache_dtype: torch.dtype, seed: int = 0):
    """The step, q/k/v for its rows, and a cache already holding every request's cached tokens."""
    gen = torch.Generator().manual_seed(seed)
    blocks_needed = [-(-(cached + n) // BLOCK_SIZE) for cached, n, _ in REQUESTS]
    order = torch.randperm(sum(blocks_needed) + 3, generator=gen).tolist()
    requests, start = [], 0
    for (cached, n, _), count in zip(REQUESTS, blocks_needed, strict=True):
        requests.append((order[start : start + count], cached, n))
        start += count
    num_decodes = sum(decode for _, _, decode in REQUESTS)
    step = AttentionStep.of(BLOCK_SIZE, requests, num_decodes, sliding_window, "cpu")
    shape = (len(order), BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k_cache, v_cache = (torch.randn(shape, generator=gen).to(cache_dtype) for _ in range(2))
    rows = step.query_start_loc[-1]
    q = torch.randn(rows, NUM_HEADS, HEAD_DIM, generator=gen)
    k, v = (torch.randn(rows, NUM_KV_HEADS, HEAD_DIM, generator=gen) for _ in range(2))
    return step, (q, k, v, k_cache, v_cache)


def _run(backend: AttentionBackend, step: AttentionStep, tensors) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The output and the caches after the step, the caches in the backend's own layout (kv_cache_shape: the
    reference's, or heads before the block's tokens) while it runs and returned in the reference's."""
    q, k, v, k_cache, v_cache = (t.clone() for t in tensors)
    blocks = k_cache.shape[0]
    layout = backend.kv_cache_shape(blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    heads_first = layout == (blocks, NUM_KV_HEADS, BLOCK_SIZE, HEAD_DIM)
    assert heads_first or layout == tuple(k_cache.shape), layout
    if heads_first:
        k_cache, v_cache = (c.transpose(1, 2).contiguous() for c in (k_cache, v_cache))
    out = backend.forward(q, k, v, k_cache, v_cache, backend.build_metadata(step), HEAD_DIM**-0.5)
    if heads_first:
        k_cache, v_cache = (c.transpose(1, 2) for c in (k_cache, v_cache))
    return out, k_cache, v_cache


def test_step_describes_requests_decodes_first():
    step = AttentionStep.of(4, [([7], 2, 1), ([3, 5], 0, 6)], 1, None, "cpu")
    assert step.query_start_loc == [0, 1, 7] and step.seq_lens == [3, 6]
    assert [step.context_len(i) for i in range(2)] == [2, 0]
    assert step.slot_mapping == [30, 12, 13, 14, 15, 20, 21]


@pytest.mark.parametrize("sliding_window", [None, 6])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("backend", ["cpu", "contiguous"])
def test_backend_matches_the_reference(backend, sliding_window, cache_dtype):
    step, tensors = _mixed_step(sliding_window, cache_dtype)
    expected = _run(_reference(), step, tensors)
    platform = CpuPlatform() if backend == "cpu" else _example_plugin().ContiguousPlatform()
    chosen = platform.get_attn_backend(platform.operator_table(torch.float32))
    assert chosen.name == ("paged" if backend == "cpu" else "contiguous")
    out, k_cache, v_cache = _run(chosen, step, tensors)
    torch.testing.assert_close(k_cache, expected[1], rtol=0, atol=0)
    torch.testing.assert_close(v_cache, expected[2], rtol=0, atol=0)
    torch.testing.assert_close(out, expected[0], rtol=1e-5, atol=1e-5)


def test_only_the_paged_metadata_takes_the_fused_decode_layer():
    decodes = AttentionStep.of(BLOCK_SIZE, [([0], 3, 1), ([1], 0, 1)], 2, None, "cpu")
    mixed = AttentionStep.of(BLOCK_SIZE, [([0], 3, 1), ([1], 0, 4)], 1, None, "cpu")
    paged = _reference()
    assert paged.is_decode_only(paged.build_metadata(decodes))
    assert not paged.is_decode_only(paged.build_metadata(mixed))
    contiguous = _example_plugin().ContiguousAttentionBackend()
    assert not contiguous.is_decode_only(contiguous.build_metadata(decodes))


def test_platform_default_is_paged_attention_over_its_operators():
    ops = CpuPlatform().operator_table(torch.float32)
    backend = Platform.get_attn_backend(CpuPlatform(), ops)
    assert isinstance(backend, PagedAttentionBackend) and backend.ops is ops
