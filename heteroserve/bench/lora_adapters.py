"""Random LoRA adapters for a model, written as PEFT folders (adapter_config.json + adapter_model.safetensors), for
`bench throughput --lora-adapters N`: the cost of serving adapters is in their shapes, not their values."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from heteroserve.lora.peft_adapter import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from heteroserve.lora.request import LoRARequest
from heteroserve.lora.targets import fused_targets
from heteroserve.model.arch import ModelArch


def write_random_adapters(arch: ModelArch, folder: Path, count: int, rank: int, seed: int = 0) -> list[LoRARequest]:
    """`count` adapters of rank `rank` on every projection (q, k, v, o, gate, up, down) of every layer."""
    gen = torch.Generator().manual_seed(seed)
    adapters = []
    for index in range(count):
        path = folder / f"adapter-{index}"
        path.mkdir(parents=True, exist_ok=True)
        tensors = {}
        for layer in range(arch.num_layers):
            for target in fused_targets(arch):
                for module, width in target.parts:
                    block = "self_attn" if module.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else "mlp"
                    prefix = f"base_model.model.model.layers.{layer}.{block}.{module}"
                    tensors[f"{prefix}.lora_A.weight"] = 0.02 * torch.randn(rank, target.in_features, generator=gen)
                    tensors[f"{prefix}.lora_B.weight"] = 0.02 * torch.randn(width, rank, generator=gen)
        save_file(tensors, path / ADAPTER_WEIGHTS)
        config = {
            "peft_type": "LORA",
            "r": rank,
            "lora_alpha": 2 * rank,
            "target_modules": [m for t in fused_targets(arch) for m, _ in t.parts],
            "bias": "none",
        }
        (path / ADAPTER_CONFIG).write_text(json.dumps(config))
        adapters.append(LoRARequest(f"adapter-{index}", index + 1, str(path)))
    return adapters
