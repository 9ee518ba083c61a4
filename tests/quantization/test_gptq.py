"""GPTQ checkpoints (AutoGPTQ / GPTQModel layout, written by tests/quantization/checkpoints.py): each linear
against dequantise-then-matmul, whole models against transformers on the decoded weights, bad input."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from heteroserve.platforms.cpu import kernels as cpu_kernels
from heteroserve.platforms.cpu.packed import CpuPackedWeight
from heteroserve.platforms.cpu.platform import CpuLinear, _int8_kernel_works
from heteroserve.platforms.operators import LinearOp
from heteroserve.quantization.act_order import PermutedInput
from heteroserve.quantization.gptq import GptqConfig, gptq_weight
from tests.model.remote_code_checkpoints import write_original_qwen
from tests.model.tiny_models import TinyModel, as_reference, build_hf_model, prompts
from tests.quantization.checkpoints import QUANT_TINY, gptq_quantize, write_quantized

CONFIGS = [
    (bits, group, desc_act, sym)
    for bits in (4, 8)
    for group in (32, 64, 128, -1)
    for desc_act in (False, True)
    for sym in (True, False)
]


def relative_error(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y - ref).norm() / ref.norm())


@pytest.mark.parametrize("bits, group, desc_act, sym", CONFIGS, ids=lambda v: str(v))
def test_gptq_linear_against_dequantised_matmul(bits, group, desc_act, sym):
    w = 0.2 * torch.randn(192, 256, generator=torch.Generator().manual_seed(bits + group))
    parts, decoded = gptq_quantize(w, bits, group, desc_act, sym)
    weight = gptq_weight("layer.q_proj", parts, GptqConfig(bits, group, desc_act, sym))
    assert isinstance(weight, PermutedInput) == (desc_act and group != -1)  # one group needs no reordering
    assert torch.allclose(weight.dequantize(), decoded, rtol=0, atol=1e-6)
    x = torch.randn(5, 256)
    reference = x @ decoded.T
    assert relative_error(LinearOp()(x, weight), reference) <= 1e-5
    cpu = CpuLinear(torch.float32, int4_kernel=cpu_kernels.load_library(), int8_kernel=_int8_kernel_works())
    for rows in (1, 5, 40):  # the int8 kernel serves up to 16 rows, dequantising beyond
        x = torch.randn(rows, 256)
        # torch's per-channel int8 kernel multiplies in bfloat16 (about 3 significant digits)
        assert relative_error(cpu(x, cpu.prepare(weight)), x @ decoded.T) <= 1e-2


def test_gptq_v2_zeros_are_stored_as_is():
    w = torch.randn(64, 128)
    parts, decoded = gptq_quantize(w, 4, 32, False, False, v2=True)
    weight = gptq_weight("m", parts, GptqConfig(4, 32, False, False, checkpoint_format="gptq_v2"))
    assert torch.allclose(weight.dequantize(), decoded, atol=1e-6)
    as_v1 = gptq_weight("m", parts, GptqConfig(4, 32, False, False))
    assert not torch.allclose(as_v1.dequantize(), decoded, atol=1e-3)  # the format setting matters


# Qwen3-MoE as Qwen3-30B-A3B-GPTQ-Int4 ships it: every expert's projections packed under their own names.
MOE = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 128, "norm_topk_prob": True}
MODEL_CASES = [  # (model type, settings, config file)
    ("llama", {"bits": 4, "group_size": 128, "desc_act": False, "sym": True}, "config.json"),
    ("qwen2", {"bits": 4, "group_size": 32, "desc_act": True, "sym": False}, "quantize_config.json"),
    ("llama", {"bits": 8, "group_size": -1, "desc_act": False, "sym": True}, "config.json"),
    (
        "qwen3",
        {"bits": 8, "group_size": 64, "desc_act": True, "sym": False, "checkpoint_format": "gptq_v2"},
        "config.json",
    ),
    ("qwen3_moe", {"bits": 4, "group_size": 64, "desc_act": False, "sym": True}, "config.json"),
]


@pytest.mark.parametrize("model_type, settings, config_file", MODEL_CASES, ids=lambda v: str(v))
def test_gptq_model_matches_transformers_on_decoded_weights(tmp_path, model_type, settings, config_file):
    overrides = MOE if model_type == "qwen3_moe" else None
    reference = as_reference(write_quantized(model_type, tmp_path / "m", "gptq", settings, config_file, overrides))
    tiny = TinyModel("gptq", tmp_path / "m", reference)
    ids = prompts(3, [40], tiny.vocab_size)[0]
    expected = torch.log_softmax(reference.logits(ids), dim=-1)
    for kernels, tolerance in (("reference", 1e-4), ("auto", 5e-2)):
        llm = tiny.llm(kernels=kernels)
        model = llm.engine.runner.model
        # Kept compressed on every path (grouped 8-bit on the CPU platform: CpuGroupedInt8Weight).
        layer = model.layers[0]
        assert not isinstance(layer.down_proj if layer.moe is None else layer.moe.experts_down[0], torch.Tensor)
        out = llm.generate({"prompt_token_ids": ids}, _prompt_logprobs(tiny.vocab_size), use_tqdm=False)[0]
        for i in range(1, len(ids)):
            ours = torch.tensor([out.prompt_logprobs[i][t].logprob for t in range(tiny.vocab_size)])
            scale = max(1.0, float(expected[i - 1].abs().max()))
            assert float((ours - expected[i - 1]).abs().max()) <= tolerance * scale, (kernels, i)


def _prompt_logprobs(vocab: int):
    from heteroserve import SamplingParams

    return SamplingParams(max_tokens=1, prompt_logprobs=vocab)


@pytest.fixture(scope="module")
def gptq_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gptq") / "m"
    write_quantized("llama", folder, "gptq", {"bits": 4, "group_size": 64, "desc_act": False, "sym": True})
    return folder


def _damaged(gptq_folder, tmp_path, edit_tensors=None, edit_config=None):
    folder = tmp_path / "damaged"
    shutil.copytree(gptq_folder, folder)
    if edit_tensors:
        tensors = load_file(str(folder / "model.safetensors"))
        edit_tensors(tensors)
        save_file(tensors, str(folder / "model.safetensors"))
    if edit_config:
        config = json.loads((folder / "config.json").read_text())
        edit_config(config["quantization_config"])
        (folder / "config.json").write_text(json.dumps(config))
    return TinyModel("damaged", folder, None)


def test_gptq_runs_compressed_and_detects_its_format(gptq_folder, tmp_path):
    tiny = TinyModel("gptq", gptq_folder, None)
    model = tiny.llm().engine.runner.model
    assert not isinstance(model.layers[0].self_attn.qkv_proj, torch.Tensor)
    float_model = tiny.llm(quantization="none").engine.runner.model
    assert isinstance(float_model.layers[0].self_attn.qkv_proj, (torch.Tensor, CpuPackedWeight))  # float32
    assert model.weight_bytes() < 0.6 * float_model.weight_bytes()  # embeddings and LM head stay float
    tiny.llm(quantization="gptq")  # the matching override is accepted
    for wrong, message in (("awq", "not a AWQ checkpoint"), ("gguf", "not a GGUF file"), ("int4", "already")):
        with pytest.raises(ValueError, match=message):
            tiny.llm(quantization=wrong)


@pytest.mark.parametrize(
    "edit_tensors, edit_config, message",
    [
        (
            lambda t: t.pop("model.layers.1.mlp.up_proj.qzeros"),
            None,
            r"missing tensor\(s\) model\.layers\.1\.mlp\.up_proj\.qzeros",
        ),
        (
            lambda t: t.pop("model.layers.0.self_attn.o_proj.scales"),
            None,
            r"model\.layers\.0\.self_attn\.o_proj\.scales",
        ),
        (None, lambda c: c.update(bits=8), r"model\.layers\.\d+\.\S+: qweight .* do not fit 8-bit GPTQ"),
        (None, lambda c: c.update(bits=3), "GPTQ with 3 bits is not supported"),
        (None, lambda c: c.update(group_size=32), "do not fit group_size 32"),
        (None, lambda c: c.update(quant_method="bitsandbytes"), "'bitsandbytes' is not supported"),
        (
            lambda t: t.update({"model.layers.0.mlp.down_proj.g_idx": torch.zeros(256, dtype=torch.int32)}),
            None,
            r"down_proj: g_idx does not assign",
        ),
    ],
    ids=["missing-qzeros", "missing-scales", "wrong-bits", "3-bit", "wrong-group", "other-method", "bad-g_idx"],
)
def test_bad_gptq_checkpoints_name_the_tensor(gptq_folder, tmp_path, edit_tensors, edit_config, message):
    tiny = _damaged(gptq_folder, tmp_path, edit_tensors, edit_config)
    with pytest.raises(ValueError, match=message):
        tiny.llm()


# The original Qwen's GPTQ projections (Qwen-7B-Chat-Int4's layout) -> the transformers Qwen2 weights they decode to.
_QWEN_GPTQ = {
    "attn.c_proj": "self_attn.o_proj",
    "mlp.w1": "mlp.up_proj",
    "mlp.w2": "mlp.gate_proj",
    "mlp.c_proj": "mlp.down_proj",
}


def test_gptq_checkpoint_of_the_original_qwen_loads_packed(tmp_path):
    """Qwen-7B-Chat-Int4's layout: the fused c_attn is one GPTQ linear, split by rows in its packed form."""
    settings = {"bits": 4, "group_size": 32, "desc_act": False, "sym": True}
    model = build_hf_model("qwen2", {**QUANT_TINY, "num_key_value_heads": 4}, seed=6)
    folder = tmp_path / "qwen-int4"
    write_original_qwen(model, folder)
    params = dict(model.named_parameters())
    size = model.config.num_attention_heads * model.config.head_dim
    packed = {}
    with torch.no_grad():
        for name, tensor in load_file(folder / "model.safetensors").items():
            layer, _, rest = name.removeprefix("transformer.h.").partition(".")
            module = rest.removesuffix(".weight")
            if module != "attn.c_attn" and module not in _QWEN_GPTQ:
                packed[name] = tensor
                continue
            parts, decoded = gptq_quantize(tensor, settings["bits"], settings["group_size"], False, True)
            packed.update({f"transformer.h.{layer}.{module}.{suffix}": t for suffix, t in parts.items()})
            if module == "attn.c_attn":
                for part, rows in zip("qkv", decoded.split(size), strict=True):
                    params[f"model.layers.{layer}.self_attn.{part}_proj.weight"].copy_(rows)
            else:
                params[f"model.layers.{layer}.{_QWEN_GPTQ[module]}.weight"].copy_(decoded)
    save_file(packed, folder / "model.safetensors")
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", **settings}
    (folder / "config.json").write_text(json.dumps(config))
    tiny = TinyModel("qwen gptq", folder, as_reference(model))
    ids = prompts(3, [40], tiny.vocab_size)[0]
    expected = torch.log_softmax(tiny.reference.logits(ids), dim=-1)
    for kernels, tolerance in (("reference", 1e-4), ("auto", 5e-2)):
        llm = tiny.llm(kernels=kernels)
        assert not isinstance(llm.engine.runner.model.layers[0].self_attn.qkv_proj, torch.Tensor)
        out = llm.generate({"prompt_token_ids": ids}, _prompt_logprobs(tiny.vocab_size), use_tqdm=False)[0]
        for i in range(1, len(ids)):
            ours = torch.tensor([out.prompt_logprobs[i][t].logprob for t in range(tiny.vocab_size)])
            scale = max(1.0, float(expected[i - 1].abs().max()))
            assert float((ours - expected[i - 1]).abs().max()) <= tolerance * scale, (kernels, i)
