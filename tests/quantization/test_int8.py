"""8-bit weights: load-time `--quantization int8`, torch's CPU int8 kernel, and fusing mixed compressed parts."""

from __future__ import annotations

import pytest
import torch

from heteroserve import SamplingParams
from heteroserve.model.loader.weights import _cat
from heteroserve.platforms.cpu import kernels as cpu_kernels
from heteroserve.platforms.cpu.int4 import CpuInt4Weight
from heteroserve.platforms.cpu.int8 import KERNEL_MAX_ROWS, CpuGroupedInt8Weight, CpuInt8Weight
from heteroserve.platforms.cpu.platform import _int8_kernel_works
from heteroserve.platforms.operators import LinearOp
from heteroserve.quantization.int4 import quantize_int4
from heteroserve.quantization.int8 import Int8Weight, quantize_int8
from tests.model.tiny_models import prompts, save_tiny
from tests.quantization.test_gptq import relative_error


@pytest.mark.parametrize("group_size", [None, 32])
def test_quantize_int8_round_trip(group_size):
    weight = torch.randn(64, 128)
    q = quantize_int8(weight, group_size)
    step = q.scale.repeat_interleave(q.group_size, dim=1)
    assert bool(((q.dequantize() - weight).abs() <= step / 2 + 1e-6).all())
    assert q.nbytes < 0.3 * weight.numel() * 4


@pytest.mark.parametrize("asymmetric", [False, True])
@pytest.mark.parametrize("rows", [1, 7, KERNEL_MAX_ROWS + 5])
def test_int8_kernel_against_dequantised_matmul(asymmetric, rows):
    base = quantize_int8(torch.randn(128, 96))
    zero = torch.randn(128, 1) if asymmetric else None
    weight = Int8Weight(base.q, base.scale, base.group_size, zero)
    x = torch.randn(rows, 96)
    reference = x @ weight.dequantize().T
    assert relative_error(LinearOp()(x, weight), reference) <= 1e-5
    if not _int8_kernel_works():
        pytest.skip("torch's CPU int8 kernel is not usable here")
    # bfloat16 activations inside the kernel (up to KERNEL_MAX_ROWS rows), float32 dequantisation beyond
    tolerance = 1e-2 if rows <= KERNEL_MAX_ROWS else 1e-5
    assert relative_error(CpuInt8Weight.pack(weight).matmul(x, None), reference) <= tolerance


@pytest.mark.parametrize("asymmetric", [False, True])
@pytest.mark.parametrize(
    "rows", [1, 5, CpuGroupedInt8Weight.KERNEL_MAX_ROWS, CpuGroupedInt8Weight.KERNEL_MAX_ROWS + 1, 64]
)
@pytest.mark.parametrize("group_size", [32, 64])
def test_grouped_int8_against_dequantised_matmul(asymmetric, rows, group_size):
    """Grouped 8-bit weights stay 8-bit: the C++ kernel up to KERNEL_MAX_ROWS rows, slices of output rows
    (the last one partial) dequantised exactly beyond; float32 arithmetic either way."""
    n = 2 * CpuGroupedInt8Weight.SLICE_ROWS + 37
    base = quantize_int8(torch.randn(n, 192), group_size=group_size)
    zero = torch.randn(n, 192 // group_size) if asymmetric else None
    weight = Int8Weight(base.q, base.scale, base.group_size, zero)
    x = torch.randn(rows, 192)
    bias = torch.randn(n)
    reference = x @ weight.dequantize().T + bias
    assert relative_error(CpuGroupedInt8Weight(weight).matmul(x, bias), reference) <= 1e-5
    if cpu_kernels.load_library():  # the fused experts read the product's rows in place: contiguous on every path
        assert torch.ops.heteroserve.int8_grouped_product(x, weight.q, weight.scale, weight.zero).is_contiguous()


@pytest.mark.parametrize("asymmetric", [False, True])
@pytest.mark.parametrize("rows", [17, 64, 700])  # 700: more than one slice of x per pass over the panels
@pytest.mark.parametrize("group_size", [32, 64])
def test_int8_panel_kernel_against_dequantised_matmul(asymmetric, rows, group_size):
    """Beyond KERNEL_MAX_ROWS, AVX-512 builds dequantise 32 output rows at a time (a 16 x 16 transpose in
    registers) into a panel of the float32 GEMM."""
    if not cpu_kernels.int8_panel_available():
        pytest.skip("the 8-bit panel kernel is built for AVX-512 only")
    n = 32 * 41
    base = quantize_int8(torch.randn(n, 192), group_size=group_size)
    zero = torch.randn(n, 192 // group_size) if asymmetric else None
    weight = Int8Weight(base.q, base.scale, base.group_size, zero)
    x = torch.randn(rows, 192)
    reference = x @ weight.dequantize().T
    out = torch.ops.heteroserve.int8_panel_linear(x, weight.q, weight.scale, weight.zero)
    assert relative_error(out, reference) <= 1e-5
    assert torch.ops.heteroserve.int8_grouped_product(x, weight.q, weight.scale, weight.zero).is_contiguous()
    assert relative_error(CpuGroupedInt8Weight(weight).matmul(x, None), reference) <= 1e-5


@pytest.mark.parametrize("kernels", ["reference", "auto"])
def test_int8_quantisation_of_a_float_checkpoint(tmp_path, kernels):
    """--quantization int8 equals transformers running the same rounded weights: our 8-bit kernels compute in
    float32 at every batch size, as the reference does."""
    tiny = save_tiny("llama3", tmp_path)
    llm = tiny.llm(quantization="int8", kernels=kernels)
    model = llm.engine.runner.model
    on_cpu = llm.engine.runner.device.type == "cpu"  # HETEROSERVE_DEVICE may name an accelerator
    kept = CpuGroupedInt8Weight if kernels == "auto" and on_cpu and cpu_kernels.load_library() else Int8Weight
    assert isinstance(model.layers[0].gate_up_proj, kept)
    with torch.no_grad():
        for name, module in tiny.reference.model.named_modules():
            if name.endswith(("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")):
                module.weight.copy_(quantize_int8(module.weight).dequantize())
    vocab = tiny.vocab_size
    ids = prompts(8, [48], vocab)[0]
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1, prompt_logprobs=vocab), use_tqdm=False)
    expected = torch.log_softmax(tiny.reference.logits(ids), dim=-1)
    for i in range(1, len(ids)):
        ours = torch.tensor([out[0].prompt_logprobs[i][t].logprob for t in range(vocab)])
        assert float((ours - expected[i - 1]).abs().max()) <= 1e-4 * max(1.0, float(expected[i - 1].abs().max()))


def test_fusing_mixed_parts_dequantises_in_the_engine_dtype():
    int4, int8 = quantize_int4(torch.randn(64, 64)), quantize_int8(torch.randn(32, 64))
    fused = _cat([int4, int8, torch.randn(32, 64).bfloat16()], torch.bfloat16)
    assert fused.dtype == torch.bfloat16 and fused.shape == (128, 64)
    assert torch.equal(fused[:64], int4.dequantize(torch.bfloat16))
    same_kind = _cat([int8, quantize_int8(torch.randn(16, 64))], torch.bfloat16)
    assert isinstance(same_kind, Int8Weight) and same_kind.shape == (48, 64)


def test_4bit_beside_8bit_parts_fuse_at_8_bits_with_the_same_values():
    """A Q4_K_M's Q4_K q/k (groups of 32) beside its Q6_K v (groups of 16): one 8-bit weight in groups of 16."""
    int4 = quantize_int4(torch.randn(64, 64), 32)
    int8 = Int8Weight(torch.randint(-32, 32, (32, 64), dtype=torch.int8), torch.rand(32, 4), 16, torch.randn(32, 4))
    plain = quantize_int8(torch.randn(32, 64))  # one group a row, no zeros
    fused = _cat([int4, int8, plain], torch.float32)
    assert isinstance(fused, Int8Weight) and fused.group_size == 16 and fused.shape == (128, 64)
    expected = torch.cat([int4.dequantize(), int8.dequantize(), plain.dequantize()])
    torch.testing.assert_close(fused.dequantize(), expected, atol=1e-6, rtol=1e-6)


def test_cpu_int4_weight_dequantises_from_its_own_layout():
    weight = quantize_int4(torch.randn(128, 256), group_size=32)
    packed = CpuInt4Weight.pack(weight.regroup(32))
    assert torch.equal(packed.dequantize(), weight.dequantize())
    assert torch.equal(packed.values(), weight.values())
