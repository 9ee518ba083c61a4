"""AWQ GEMM checkpoints (AutoAWQ layout, written by tests/quantization/checkpoints.py)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from heteroserve import SamplingParams
from heteroserve.platforms.cpu import kernels as cpu_kernels
from heteroserve.platforms.cpu.platform import CpuLinear
from heteroserve.platforms.operators import LinearOp
from heteroserve.quantization.awq import AwqConfig, awq_weight
from tests.model.tiny_models import TinyModel, as_reference, prompts
from tests.quantization.checkpoints import awq_quantize, pack_along_columns, write_quantized
from tests.quantization.test_gptq import relative_error


@pytest.mark.parametrize("group", [32, 64, 128])
def test_awq_linear_against_dequantised_matmul(group):
    w = 0.2 * torch.randn(192, 256, generator=torch.Generator().manual_seed(group))
    parts, decoded = awq_quantize(w, group)
    weight = awq_weight("layer.up_proj", parts, AwqConfig(group_size=group))
    assert torch.allclose(weight.dequantize(), decoded, rtol=0, atol=1e-6)
    x = torch.randn(7, 256)
    assert relative_error(LinearOp()(x, weight), x @ decoded.T) <= 1e-5
    if cpu_kernels.load_library():
        cpu = CpuLinear(torch.float32, int4_kernel=True)
        assert relative_error(cpu(x, cpu.prepare(weight)), x @ decoded.T) <= 1e-5  # float32 inside the kernel


def test_awq_interleaved_order_matters():
    """The same integers packed in plain order (as GPTQ packs along N) decode to a different weight."""
    parts, decoded = awq_quantize(torch.randn(64, 128), 64)
    q = awq_weight("m", parts, AwqConfig(group_size=64)).values()
    plain = dict(parts, qweight=pack_along_columns(q.t().numpy().astype("int64"), 4))
    assert not torch.allclose(awq_weight("m", plain, AwqConfig(group_size=64)).dequantize(), decoded, atol=1e-3)


@pytest.fixture(scope="module")
def awq_model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("awq") / "m"
    settings = {"bits": 4, "group_size": 64, "zero_point": True, "version": "GEMM"}
    return TinyModel("awq", folder, as_reference(write_quantized("qwen2", folder, "awq", settings)))


def test_awq_model_matches_transformers_on_decoded_weights(awq_model):
    ids = prompts(4, [40], awq_model.vocab_size)[0]
    vocab = awq_model.vocab_size
    expected = torch.log_softmax(awq_model.reference.logits(ids), dim=-1)
    for kernels, tolerance in (("reference", 1e-4), ("auto", 5e-2)):
        llm = awq_model.llm(kernels=kernels)
        assert not isinstance(llm.engine.runner.model.layers[0].gate_up_proj, torch.Tensor)
        out = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1, prompt_logprobs=vocab))[0]
        for i in range(1, len(ids)):
            ours = torch.tensor([out.prompt_logprobs[i][t].logprob for t in range(vocab)])
            scale = max(1.0, float(expected[i - 1].abs().max()))
            assert float((ours - expected[i - 1]).abs().max()) <= tolerance * scale, (kernels, i)


def test_awq_overrides_and_bad_input(awq_model, tmp_path):
    awq_model.llm(quantization="awq")
    with pytest.raises(ValueError, match="not a GPTQ checkpoint"):
        awq_model.llm(quantization="gptq")
    folder = tmp_path / "bad"
    shutil.copytree(awq_model.folder, folder)
    tensors = load_file(str(folder / "model.safetensors"))
    del tensors["model.layers.2.self_attn.v_proj.qweight"]
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing tensor\(s\) model\.layers\.2\.self_attn\.v_proj\.qweight"):
        TinyModel("bad", folder, None).llm()
    config = json.loads((awq_model.folder / "config.json").read_text())
    for change, message in (({"version": "gemv"}, "'gemv' is not supported"), ({"bits": 8}, "AWQ with 8 bits")):
        shutil.copy(awq_model.folder / "model.safetensors", folder / "model.safetensors")
        edited = dict(config, quantization_config={**config["quantization_config"], **change})
        (folder / "config.json").write_text(json.dumps(edited))
        with pytest.raises(ValueError, match=message):
            TinyModel("bad", folder, None).llm()
