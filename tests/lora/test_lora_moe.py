"""LoRA on a mixture-of-experts base (Qwen3-MoE): a peft adapter of the attention projections against peft's merged
model, and adapters of a layer's experts refused by name (peft's, which targets the experts' fused parameters, and
one naming the layer's MLP projections as a dense layer has them)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from heteroserve.lora.request import LoRARequest
from tests.lora.adapters import ATTENTION, MLP, save_adapter
from tests.model.tiny_models import check_output, greedy_params, prompts, run, save_tiny


def test_adapter_on_a_mixture_of_experts_base(tmp_path, greedy_comparison):
    base = save_tiny("qwen3_moe", tmp_path / "base")
    adapter = save_adapter(base.reference.model, tmp_path / "adapter", "moe", 1, targets=ATTENTION, seed=5)
    llm = base.llm(enable_lora=True, max_lora_rank=8)
    token_prompts = prompts(11, [9, 30], base.vocab_size)
    outputs = llm.generate(
        [{"prompt_token_ids": p} for p in token_prompts],
        greedy_params(base.vocab_size),
        use_tqdm=False,
        lora_request=adapter.request,
    )
    for i, (output, prompt) in enumerate(zip(outputs, token_prompts, strict=True)):
        check_output(f"qwen3_moe+lora[{i}]", output, prompt, adapter.reference, greedy_comparison)
    base_tokens = run(llm, token_prompts[:1], greedy_params(base.vocab_size, prompt_logprobs=False))
    assert base_tokens[0].outputs[0].token_ids != outputs[0].outputs[0].token_ids  # the adapter changes them

    peft_experts = save_adapter(base.reference.model, tmp_path / "peft_experts", "pe", 3, targets=MLP, seed=6)
    assert any(".mlp.experts." in k for k in load_file(peft_experts.path / "adapter_model.safetensors"))
    # peft targets the experts' fused parameters with per-module ranks, refused as such before their tensors are read
    with pytest.raises(ValueError, match=r"LoRA adapter 'pe': per-module ranks"):
        llm.generate([{"prompt_token_ids": [1, 2]}], use_tqdm=False, lora_request=peft_experts.request)

    experts = tmp_path / "experts"
    experts.mkdir()
    (experts / "adapter_config.json").write_bytes((adapter.path / "adapter_config.json").read_bytes())
    a, b = torch.randn(8, 64), torch.randn(32, 8)
    moe_mlp = "base_model.model.model.layers.1.mlp.gate_proj"
    save_file({f"{moe_mlp}.lora_A.weight": a, f"{moe_mlp}.lora_B.weight": b}, experts / "adapter_model.safetensors")
    with pytest.raises(ValueError, match=r"targets layer 1's MLP, a mixture of experts"):
        llm.generate(
            [{"prompt_token_ids": [1, 2]}], use_tqdm=False, lora_request=LoRARequest("experts", 2, str(experts))
        )
