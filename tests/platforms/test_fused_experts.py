"""The CPU platform's fused experts kernel (csrc/moe_experts.cpp) against model/moe.py's expert-by-expert path.

Given the same routing both run the same kernels in the same order, so they must agree bit for bit, for every
expert weight form the kernel takes and at row counts on both sides of the kernels' decode/prompt switch (16 rows).
The fused router product (the float32 GEMM) must give a row the same bits at every row count, so a token's result
does not depend on the batch (torch's product, which the expert-by-expert path uses, does not). The families'
answers against transformers (tests/model/test_architectures.py, test_gguf_moe.py) run through the fused kernel
as well, as any MoE model on the CPU does.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from heteroserve.model.arch import MoESpec
from heteroserve.model.moe import MoEBlock, route
from heteroserve.platforms.cpu.packed import bfloat16_gemm_available
from heteroserve.platforms.cpu.platform import CpuPlatform
from heteroserve.quantization.int4 import quantize_int4
from heteroserve.quantization.int8 import Int8Weight, quantize_int8
from tests.model.tiny_models import greedy_params, prompts, run, save_tiny

HIDDEN, INTER, EXPERTS, TOP_K = 128, 64, 8, 2
ROWS = [1, 3, 17, 40]  # 17 and 40: past the 16-row decode kernels; 40 gives some expert more than 16 rows


def asymmetric_int8(weight: torch.Tensor) -> Int8Weight:
    """Grouped 8-bit with a zero per group (GPTQ's asymmetric 8-bit)."""
    symmetric = quantize_int8(weight, 32)
    return Int8Weight(symmetric.q, symmetric.scale, 32, torch.full_like(symmetric.scale, 0.01))


FORMS = {
    "float32": (torch.float32, lambda w: w),
    "bfloat16": (torch.bfloat16, lambda w: w.bfloat16()),
    "int4": (torch.float32, lambda w: quantize_int4(w, 32)),
    "int8 grouped": (torch.float32, lambda w: quantize_int8(w, 32)),
    "int8 with zeros": (torch.float32, asymmetric_int8),
    "int8 per channel": (torch.float32, lambda w: quantize_int8(w)),
}


def moe_block(form: str, seed: int = 0) -> MoEBlock:
    dtype, convert = FORMS[form]
    if dtype == torch.bfloat16 and not bfloat16_gemm_available():
        pytest.skip("the bfloat16 GEMM kernel is not built on this CPU")
    ops = CpuPlatform().operator_table(dtype)
    block = MoEBlock(MoESpec(num_experts=EXPERTS, top_k=TOP_K, intermediate_size=INTER), HIDDEN, ops, "silu", None)
    gen = torch.Generator().manual_seed(seed)
    block.router.data = torch.randn(EXPERTS, HIDDEN, generator=gen)  # sharp routing: weights far from a tie
    block.experts_gate_up = [convert(0.2 * torch.randn(2 * INTER, HIDDEN, generator=gen)) for _ in range(EXPERTS)]
    block.experts_down = [convert(0.2 * torch.randn(HIDDEN, INTER, generator=gen)) for _ in range(EXPERTS)]
    block.prepare_experts(ops.linear.prepare)
    return block


def router_logits(block: MoEBlock, h: torch.Tensor) -> torch.Tensor:
    """The router's logits as the fused routing computes them (the float32 GEMM on its packed router)."""
    fused = block.fused_experts
    return torch.ops.heteroserve.packed_linear(h.float(), fused.router, fused.num_experts, fused.router_bias)


def expert_by_expert(block: MoEBlock, h: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    fused, block.fused_experts = block.fused_experts, None
    try:
        return block._experts(h, ids, weights)
    finally:
        block.fused_experts = fused


@pytest.mark.parametrize("form", list(FORMS))
def test_fused_experts_equal_the_expert_by_expert_path(form):
    block = moe_block(form)
    assert block.fused_experts is not None, f"{form} experts should take the fused kernel"
    dtype = FORMS[form][0]
    gen = torch.Generator().manual_seed(1)
    for rows in ROWS:
        h = torch.randn(rows, HIDDEN, generator=gen).to(dtype)
        logits = router_logits(block, h)
        assert torch.allclose(logits, F.linear(h.float(), block.router), rtol=1e-5, atol=1e-5)
        weights, ids = route(logits, block.spec, None)
        fused = block._experts(h, ids, weights)
        reference = expert_by_expert(block, h, ids, weights)
        assert fused.dtype == torch.float32 and fused.shape == (rows, HIDDEN)
        assert torch.equal(fused, reference), f"{form}, {rows} rows: max diff {(fused - reference).abs().max()}"
        assert fused.abs().max() > 0.1  # the experts contributed


@pytest.mark.parametrize("form", ["float32", "int4", "int8 grouped"])
def test_a_token_gets_the_same_bits_alone_and_in_any_batch(form):
    block = moe_block(form, seed=2)
    h = torch.randn(40, HIDDEN, generator=torch.Generator().manual_seed(3))
    batched = block._routed(h)
    for i in (0, 17, 39):
        assert torch.equal(block._routed(h[i : i + 1]), batched[i : i + 1])
        assert torch.equal(block._routed(h[i : i + 5]), batched[i : i + 5])


ROUTINGS = {
    "softmax top-k": MoESpec(16, 4, INTER, renormalize=False),
    "softmax top-k renormalised": MoESpec(16, 4, INTER),
    "sigmoid with a correction bias, scaled": MoESpec(
        16, 4, INTER, scoring="sigmoid", correction_bias=True, renormalize=True, routed_scale=2.5
    ),
    "groups by their two best (DeepSeek-V3)": MoESpec(
        16, 4, INTER, scoring="sigmoid", correction_bias=True, renormalize=True, num_groups=4, top_groups=2
    ),
    "groups by their best (DeepSeek-V2)": MoESpec(16, 4, INTER, num_groups=4, top_groups=2, group_score="max"),
    "one group of two kept": MoESpec(16, 2, INTER, num_groups=8, top_groups=1, routed_scale=16.0),
}


@pytest.mark.parametrize("routing", list(ROUTINGS))
def test_the_kernels_routing_chooses_as_the_python_routing(routing):
    """csrc/moe_experts.cpp's moe_route against model/moe.py's route on the same logits: the same experts in the
    same order, the same weights up to the softmax's rounding; and where groups limit the choice, some tokens'
    experts differ from an unlimited choice (the groups are applied, not ignored)."""
    spec = ROUTINGS[routing]
    ops = CpuPlatform().operator_table(torch.float32)
    block = MoEBlock(spec, HIDDEN, ops, "silu", None)
    gen = torch.Generator().manual_seed(4)
    block.router.data = torch.randn(spec.num_experts, HIDDEN, generator=gen) / HIDDEN**0.5
    if block.correction_bias is not None:
        block.correction_bias.data = 0.1 * torch.randn(spec.num_experts, generator=gen)
    block.experts_gate_up = [torch.randn(2 * INTER, HIDDEN, generator=gen) for _ in range(spec.num_experts)]
    block.experts_down = [torch.randn(HIDDEN, INTER, generator=gen) for _ in range(spec.num_experts)]
    block.prepare_experts(ops.linear.prepare)
    h = torch.randn(64, HIDDEN, generator=gen)
    weights, ids = block.fused_experts.route(h)
    logits = router_logits(block, h)
    expected_weights, expected_ids = route(logits, spec, block.correction_bias)
    assert torch.equal(ids, expected_ids)
    torch.testing.assert_close(weights, expected_weights, rtol=1e-6, atol=0)
    if spec.num_groups > 1:
        _, unlimited = route(logits, dataclasses.replace(spec, num_groups=1, top_groups=1), block.correction_bias)
        changed = (unlimited.sort(dim=1).values != expected_ids.sort(dim=1).values).any(dim=1).sum().item()
        print(f"{routing}: {changed} of {len(h)} tokens choose other experts than without groups")
        assert changed > 0


def test_experts_the_kernel_does_not_take_run_expert_by_expert():
    ops = CpuPlatform().operator_table(torch.float32)
    spec = MoESpec(num_experts=2, top_k=1, intermediate_size=INTER)
    gelu = MoEBlock(spec, HIDDEN, ops, "gelu_tanh", None)
    gelu.experts_gate_up = [torch.randn(2 * INTER, HIDDEN) for _ in range(2)]
    gelu.experts_down = [torch.randn(HIDDEN, INTER) for _ in range(2)]
    gelu.prepare_experts(ops.linear.prepare)
    assert gelu.fused_experts is None
    mixed = MoEBlock(spec, HIDDEN, ops, "silu", None)
    mixed.experts_gate_up = [torch.randn(2 * INTER, HIDDEN), quantize_int4(torch.randn(2 * INTER, HIDDEN), 32)]
    mixed.experts_down = [torch.randn(HIDDEN, INTER) for _ in range(2)]
    mixed.prepare_experts(ops.linear.prepare)
    assert mixed.fused_experts is None
    assert ops.describe()["moe_experts"] == "cpp fused experts"
    assert CpuPlatform().operator_table(torch.float32, kernels="reference").describe()["moe_experts"] == (
        "expert by expert"
    )


def test_a_moe_model_runs_its_experts_fused_with_the_expert_by_expert_tokens(tmp_path):
    tiny = save_tiny("qwen2_moe", tmp_path)
    token_prompts = prompts(5, [6, 21], tiny.vocab_size)
    params = greedy_params(tiny.vocab_size, max_tokens=8)
    fused_llm = tiny.llm()
    layers = [layer.moe for layer in fused_llm.engine.runner.model.layers if layer.moe is not None]
    assert layers and all(moe.fused_experts is not None for moe in layers)
    fused = run(fused_llm, token_prompts, params)
    del fused_llm
    plain_llm = tiny.llm()
    for layer in plain_llm.engine.runner.model.layers:
        if layer.moe is not None:
            layer.moe.fused_experts = None
    plain = run(plain_llm, token_prompts, params)
    # The routers' products differ in summation order only (the fused one on the float32 GEMM).
    for a, b in zip(fused, plain, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].cumulative_logprob == pytest.approx(b.outputs[0].cumulative_logprob, abs=1e-4)
