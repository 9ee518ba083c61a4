"""Random LoRA adapters made by `peft` itself on a tiny base model, and the merged transformers model of each
(peft's merge_and_unload) as the reference."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model

from heteroserve.lora.request import LoRARequest
from tests.model.tiny_models import as_reference
from tests.reference import HFReference

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]


@dataclass
class TinyAdapter:
    request: LoRARequest
    reference: HFReference  # the base model with the adapter merged in

    @property
    def path(self) -> Path:
        return Path(self.request.lora_path)


def save_adapter(
    base,
    folder: Path,
    name: str,
    lora_id: int,
    *,
    rank: int = 8,
    alpha: float = 16,
    targets: list[str] | None = None,
    use_rslora: bool = False,
    seed: int = 0,
    std: float = 0.2,
) -> TinyAdapter:
    """An adapter whose A and B are N(0, std) (PEFT's own init leaves B zero, which would change nothing), saved
    with PEFT's save_pretrained."""
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        target_modules=targets or ATTENTION + MLP,
        lora_dropout=0.0,
        use_rslora=use_rslora,
        init_lora_weights=False,
    )
    model = get_peft_model(copy.deepcopy(base), config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if "lora_" in param_name:
                param.copy_(std * torch.randn(param.shape, generator=gen))
    model.save_pretrained(folder)
    merged = model.merge_and_unload()
    return TinyAdapter(LoRARequest(name, lora_id, str(folder)), as_reference(merged))
