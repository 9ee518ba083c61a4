"""gpt-oss's MXFP4 experts: our dequantisation against transformers' (`convert_moe_packed_tensors`) on random
bytes, and a tiny gpt-oss checkpoint stored as the released ones are (experts as MXFP4 blocks and scales, the rest
bfloat16-able floats) against transformers loading the same checkpoint with its own dequantisation."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, Mxfp4Config
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from heteroserve.quantization.mxfp4 import FP4_VALUES, dequantize_mxfp4
from tests.model.tiny_models import (
    TinyModel,
    as_reference,
    check_output,
    greedy_params,
    prompts,
    run,
    save_tiny,
)


def test_dequantisation_matches_transformers():
    gen = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 64, 4, 16), dtype=torch.uint8, generator=gen)
    scales = torch.randint(118, 136, (3, 64, 4), dtype=torch.uint8, generator=gen)
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [3, 128, 64]: input-major
    assert torch.equal(dequantize_mxfp4(blocks, scales).transpose(1, 2), theirs)


def _mxfp4(stack: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An input-major float stack [E, K, N] as the checkpoints store it: blocks [E, N, K / 32, 16], scales
    [E, N, K / 32], each block's scale the power of two that brings its largest value to at most 6."""
    rows = stack.transpose(1, 2).float()
    blocks = rows.reshape(*rows.shape[:2], -1, 32)
    exponent = torch.ceil(torch.log2(blocks.abs().amax(-1).clamp_min(1e-30) / 6.0)).clamp(-127, 127)
    scaled = blocks / torch.exp2(exponent)[..., None]
    grid = torch.tensor(FP4_VALUES)
    codes = (scaled[..., None] - grid).abs().argmin(-1).to(torch.uint8)  # nearest FP4 value (ties: lower code)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed, (exponent + 127).to(torch.uint8)


@pytest.fixture(scope="module")
def mxfp4_gpt_oss(tmp_path_factory) -> TinyModel:
    tiny = save_tiny("gpt_oss", tmp_path_factory.mktemp("mxfp4"))
    folder = tiny.folder.with_name("gpt_oss_mxfp4")
    folder.mkdir()
    tensors = {}
    for name, tensor in load_file(str(tiny.folder / "model.safetensors")).items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            tensors[name + "_blocks"], tensors[name + "_scales"] = _mxfp4(tensor)
        else:
            tensors[name] = tensor
    save_file(tensors, str(folder / "model.safetensors"))
    config = json.loads((tiny.folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": None}
    (folder / "config.json").write_text(json.dumps(config))
    reference = AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager", quantization_config=Mxfp4Config(dequantize=True)
    )
    return TinyModel("gpt_oss_mxfp4", folder, as_reference(reference))


def test_mxfp4_checkpoint_matches_transformers(mxfp4_gpt_oss, greedy_comparison):
    tiny = mxfp4_gpt_oss
    token_prompts = prompts(13, [30, 9], tiny.vocab_size)
    outputs = run(tiny.llm(), token_prompts, greedy_params(tiny.vocab_size))
    for i, (output, prompt) in enumerate(zip(outputs, token_prompts, strict=True)):
        check_output(f"gpt-oss mxfp4[{i}]", output, prompt, tiny.reference, greedy_comparison)


def test_mxfp4_experts_quantised_to_4_bits_at_load(mxfp4_gpt_oss):
    llm = mxfp4_gpt_oss.llm(quantization="int4")
    moe = llm.engine.runner.model.layers[0].moe
    assert not isinstance(moe.experts_gate_up[0], torch.Tensor)
    outputs = run(llm, prompts(14, [12], mxfp4_gpt_oss.vocab_size), greedy_params(mxfp4_gpt_oss.vocab_size))
    assert len(outputs[0].outputs[0].token_ids) == 16


def test_a_stack_without_its_scales_is_named(mxfp4_gpt_oss, tmp_path):
    tensors = load_file(str(mxfp4_gpt_oss.folder / "model.safetensors"))
    del tensors["model.layers.1.mlp.experts.down_proj_scales"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_bytes((mxfp4_gpt_oss.folder / "config.json").read_bytes())
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.experts\.down_proj_blocks but no .*_scales"):
        TinyModel("broken", tmp_path, None).llm()
