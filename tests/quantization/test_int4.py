"""4-bit weights: GGUF Q4_0/Q4_1 kept compressed, load-time int4 quantisation, and their kernels."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType

from heteroserve import LLM, SamplingParams
from heteroserve.platforms.cpu import kernels as cpu_kernels
from heteroserve.platforms.cpu.int4 import CpuInt4Weight
from heteroserve.platforms.cpu.packed import CpuPackedWeight
from heteroserve.platforms.operators import LinearOp
from heteroserve.quantization.int4 import Int4Weight, quantize_int4
from tests.model.test_gguf import COMMON_GGUF, write_gguf
from tests.model.tiny_models import build_hf_model, prompts, save_tiny

Q4_TYPES = [GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1]
KERNEL = cpu_kernels.load_library()


def _relative_error(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y - ref).norm() / ref.norm())


@pytest.mark.parametrize("rows", [1, 3, 7, 8, 17, 64])
def test_int4_linear_against_dequantised_matmul(rows):
    weight = quantize_int4(torch.randn(192, 320))
    x = torch.randn(rows, 320)
    reference = x @ weight.dequantize().T
    assert _relative_error(LinearOp()(x, weight), reference) <= 1e-5
    if not KERNEL:
        pytest.skip("the C++ kernels cannot be built here: the dequantising path is what runs")
    packed = CpuInt4Weight.pack(weight)
    assert torch.equal(packed.dequantize(), weight.dequantize())
    assert _relative_error(packed.matmul(x, None), reference) <= 1e-5


@pytest.mark.parametrize("group", [32, 64, 256])
def test_int4_rows_get_the_same_bits_at_every_row_count(group):
    """Batch invariance (issue 23): row r of an M-row product is bit for bit the row multiplied alone, for every M,
    across the kernel's few-row path and its panel path (tiles of every height, slices of rows)."""
    if not cpu_kernels.load_library():
        pytest.skip("the C++ kernels cannot be built here")
    weight = quantize_int4(torch.randn(192, 512), group_size=group)
    packed = CpuInt4Weight.pack(weight)
    x = torch.randn(300, 512)
    x[2, 64:96] = 0
    alone = torch.cat([packed.matmul(x[r : r + 1], None) for r in range(len(x))])
    for rows in [*range(1, 40), 64, 100, 300]:
        assert torch.equal(packed.matmul(x[:rows], None), alone[:rows]), f"{rows} rows"
    assert _relative_error(alone, x @ weight.dequantize().T) <= 1e-5


def test_quantize_int4_round_trip():
    weight = torch.randn(64, 128)
    q = quantize_int4(weight, group_size=32)
    step = q.scale.repeat_interleave(32, dim=1)
    assert bool(((q.dequantize() - weight).abs() <= step / 2 + 1e-6).all())
    assert q.nbytes < weight.numel() * 4 / 4  # under a quarter of float32, scales included


@pytest.fixture(scope="module", params=Q4_TYPES, ids=lambda t: t.name)
def q4_gguf(request, tmp_path_factory):
    model = build_hf_model("llama", {**COMMON_GGUF, "tie_word_embeddings": False}, seed=21)
    return write_gguf(model, tmp_path_factory.mktemp("q4") / f"tiny-{request.param.name}.gguf", request.param)


def test_q4_gguf_runs_compressed_and_matches_its_dequantised_self(q4_gguf):
    quantized = LLM(str(q4_gguf), max_model_len=128, num_kv_blocks=32)
    float_model = LLM(str(q4_gguf), max_model_len=128, num_kv_blocks=32, quantization="none")
    layer = quantized.engine.runner.model.layers[0]
    assert isinstance(layer.gate_up_proj, (Int4Weight, CpuInt4Weight))
    assert isinstance(float_model.engine.runner.model.layers[0].gate_up_proj, (torch.Tensor, CpuPackedWeight))
    assert quantized.engine.runner.model.weight_bytes() < 0.5 * float_model.engine.runner.model.weight_bytes()
    vocab = quantized.engine.runner.arch.vocab_size
    ids = prompts(7, [40], vocab)[0]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=vocab, prompt_logprobs=vocab)
    ours = quantized.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0]
    theirs = float_model.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0]
    dense = lambda entry: torch.tensor([entry[t].logprob for t in range(vocab)])  # noqa: E731
    # The CPU int4 kernel multiplies in bfloat16 (~3 significant digits); through three layers of this
    # random model that stays within 5% of the logit scale (a wrong layout or scale is off by the scale).
    bound = lambda ref: 5e-2 * max(1.0, float(ref.abs().max()))  # noqa: E731
    for a, b in zip(ours.prompt_logprobs[1:], theirs.prompt_logprobs[1:], strict=True):
        assert float((dense(a) - dense(b)).abs().max()) <= bound(dense(b))
    for step, (a, b) in enumerate(zip(ours.outputs[0].logprobs, theirs.outputs[0].logprobs, strict=True)):
        assert float((dense(a) - dense(b)).abs().max()) <= bound(dense(b)), step
        if ours.outputs[0].token_ids[: step + 1] != theirs.outputs[0].token_ids[: step + 1]:
            top2 = dense(b).topk(2).values
            assert float(top2[0] - top2[1]) < bound(dense(b)), "diverged away from a near-tie"
            break


@pytest.mark.parametrize("kernels, tolerance", [("reference", 1e-4), ("auto", 5e-2)])
def test_int4_quantisation_of_a_float_checkpoint(tmp_path, kernels, tolerance):
    """--quantization int4 equals transformers running the same rounded weights: exactly with the
    dequantising reference kernel, within bfloat16 precision with the CPU int4 kernel."""
    tiny = save_tiny("qwen2", tmp_path)
    llm = tiny.llm(quantization="int4", kernels=kernels)
    assert isinstance(llm.engine.runner.model.layers[0].self_attn.qkv_proj, (Int4Weight, CpuInt4Weight))
    reference = tiny.reference.model
    with torch.no_grad():
        for name, module in reference.named_modules():
            if name.endswith(("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")):
                module.weight.copy_(quantize_int4(module.weight).dequantize())
    vocab = tiny.vocab_size
    ids = prompts(8, [48], vocab)[0]
    params = SamplingParams(max_tokens=1, prompt_logprobs=vocab)
    out = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0]
    expected = torch.log_softmax(tiny.reference.logits(ids), dim=-1)
    for i in range(1, len(ids)):
        ours = torch.tensor([out.prompt_logprobs[i][t].logprob for t in range(vocab)])
        assert float((ours - expected[i - 1]).abs().max()) <= tolerance * max(1.0, float(expected[i - 1].abs().max()))


def test_quantization_mismatches_are_clear(tmp_path, q4_gguf):
    tiny = save_tiny("llama_tied", tmp_path)
    with pytest.raises(ValueError, match="not a GGUF file"):
        tiny.llm(quantization="gguf")
    with pytest.raises(ValueError, match="already quantised"):
        LLM(str(q4_gguf), max_model_len=64, num_kv_blocks=8, quantization="int4")
    with pytest.raises(ValueError, match="quantization must be one of"):
        tiny.llm(quantization="awq-ish")
