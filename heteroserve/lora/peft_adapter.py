"""PEFT LoRA adapter folders (`adapter_config.json` + `adapter_model.safetensors`): checked against the base
model before anything runs, then read as per-layer matrices with the adapter's scaling folded in."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from heteroserve.lora.targets import fused_targets, module_names
from heteroserve.model.arch import ModelArch

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight (a VL model adds language_model.)
_TENSOR_NAME = re.compile(
    r"^base_model\.model\.(?:model\.)?(?:language_model\.)?layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$"
)
# Settings that change what an adapter computes and that we do not implement: refused rather than ignored.
_UNSUPPORTED = {
    "use_dora": "DoRA (weight-decomposed LoRA)",
    "lora_bias": "LoRA biases",
    "fan_in_fan_out": "fan_in_fan_out (Conv1D-style) weights",
    "rank_pattern": "per-module ranks (rank_pattern)",
    "alpha_pattern": "per-module alphas (alpha_pattern)",
    "target_parameters": "target_parameters",
    "layer_replication": "layer_replication",
    "use_qalora": "QALoRA",
}


class LoRAAdapterError(ValueError):
    """An adapter that cannot run on this base model; the message names the adapter and the problem."""


@dataclass(frozen=True)
class AdapterConfig:
    rank: int
    alpha: float
    use_rslora: bool
    target_modules: frozenset[str]  # our module names the adapter's tensors modify

    @property
    def scaling(self) -> float:
        """PEFT's: alpha / r, or alpha / sqrt(r) with rsLoRA."""
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)


@dataclass
class AdapterWeights:
    """layers[i][module] = (A [r, in], B [out, r] times the scaling), for the modules the adapter targets."""

    config: AdapterConfig
    layers: list[dict[str, tuple[torch.Tensor, torch.Tensor]]]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self.layers for pair in layer.values() for t in pair)


def inspect_adapter(name: str, path: str, arch: ModelArch, max_rank: int) -> AdapterConfig:
    """The adapter's settings, after checking its config and its tensors' names and shapes against the base model
    (the safetensors header only: no weights are read). LoRAAdapterError names what is wrong."""
    folder = Path(path)
    if not folder.is_dir():
        raise LoRAAdapterError(f"LoRA adapter {name!r}: {path} is not a folder (expected a PEFT adapter folder)")
    config_file = folder / ADAPTER_CONFIG
    if not config_file.is_file():
        raise LoRAAdapterError(f"LoRA adapter {name!r}: {path} has no {ADAPTER_CONFIG}")
    weights_file = folder / ADAPTER_WEIGHTS
    if not weights_file.is_file():
        found = (
            " (it has adapter_model.bin: save with safe_serialization=True)"
            if (folder / "adapter_model.bin").exists()
            else ""
        )
        raise LoRAAdapterError(f"LoRA adapter {name!r}: {path} has no {ADAPTER_WEIGHTS}{found}")
    try:
        settings = json.loads(config_file.read_text())
    except (OSError, ValueError) as exc:
        raise LoRAAdapterError(f"LoRA adapter {name!r}: {ADAPTER_CONFIG} is not valid JSON ({exc})") from exc
    rank, alpha = _check_settings(name, settings, arch, max_rank)
    targets = _check_tensors(name, weights_file, arch, rank)
    return AdapterConfig(rank, alpha, bool(settings.get("use_rslora")), targets)


def load_adapter(name: str, path: str, arch: ModelArch, max_rank: int, dtype: torch.dtype) -> AdapterWeights:
    """The adapter's matrices in `dtype`, checked as `inspect_adapter` checks them."""
    config = inspect_adapter(name, path, arch, max_rank)
    layers: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = [{} for _ in range(arch.num_layers)]
    qk_order = arch.qk_row_order()  # the model's q/k rows are reordered at load; the adapter's B rows follow
    with safe_open(Path(path) / ADAPTER_WEIGHTS, framework="pt") as tensors:
        for key in tensors.keys():  # noqa: SIM118 - safe_open has no __iter__
            layer, module, kind = _parse(key)
            a, b = layers[layer].get(module, (None, None))
            tensor = tensors.get_tensor(key).to(torch.float32)
            if kind == "A":
                a = tensor.to(dtype)
            else:
                b = (tensor * config.scaling).to(dtype)
                if qk_order is not None and module in ("q_proj", "k_proj"):
                    heads = b.shape[0] // arch.head_dim
                    b = b[(torch.arange(heads)[:, None] * arch.head_dim + qk_order[None, :]).flatten()]
            layers[layer][module] = (a, b)
    return AdapterWeights(config, layers)


def _check_settings(name: str, settings: dict, arch: ModelArch, max_rank: int) -> tuple[int, float]:
    if settings.get("peft_type", "LORA") != "LORA":
        raise LoRAAdapterError(f"LoRA adapter {name!r}: peft_type is {settings.get('peft_type')!r}, not LORA")
    rank = settings.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise LoRAAdapterError(f"LoRA adapter {name!r}: r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise LoRAAdapterError(
            f"LoRA adapter {name!r}: rank {rank} is above max_lora_rank={max_rank} (raise --max-lora-rank)"
        )
    alpha = settings.get("lora_alpha", 8)
    if not isinstance(alpha, (int, float)):
        raise LoRAAdapterError(f"LoRA adapter {name!r}: lora_alpha must be a number, got {alpha!r}")
    saved = settings.get("modules_to_save")
    if saved:
        raise LoRAAdapterError(
            f"LoRA adapter {name!r}: modules_to_save ({', '.join(saved)}) is not supported: such an adapter "
            "replaces whole modules of the base model, which a shared base cannot serve per request"
        )
    if settings.get("bias", "none") != "none":
        raise LoRAAdapterError(f"LoRA adapter {name!r}: bias={settings['bias']!r} is not supported (only 'none')")
    for key, what in _UNSUPPORTED.items():
        if settings.get(key):
            raise LoRAAdapterError(f"LoRA adapter {name!r}: {what} ({key} in {ADAPTER_CONFIG}) is not supported")
    targets = settings.get("target_modules")
    if isinstance(targets, list):
        known = module_names(arch)
        unknown = [t for t in targets if t.rsplit(".", 1)[-1] not in known]
        if unknown:
            raise LoRAAdapterError(
                f"LoRA adapter {name!r}: unknown target module {unknown[0]!r} (supported: {', '.join(known)})"
            )
    return rank, float(alpha)


def _parse(key: str) -> tuple[int, str, str]:
    match = _TENSOR_NAME.match(key)
    if match is None:
        raise LoRAAdapterError(f"tensor {key!r} is not a LoRA matrix of a decoder layer's projection")
    return int(match.group(1)), match.group(2), match.group(3)


def _check_tensors(name: str, weights_file: Path, arch: ModelArch, rank: int) -> frozenset[str]:
    widths = {part: (target.in_features, width) for target in fused_targets(arch) for part, width in target.parts}
    seen: dict[tuple[int, str], set[str]] = {}
    with safe_open(weights_file, framework="pt") as tensors:
        for key in tensors.keys():  # noqa: SIM118 - safe_open has no __iter__
            try:
                layer, module, kind = _parse(key)
            except LoRAAdapterError as exc:
                raise LoRAAdapterError(f"LoRA adapter {name!r}: {exc}") from None
            if module not in widths:
                raise LoRAAdapterError(
                    f"LoRA adapter {name!r}: unknown target module {module!r} in {key} (supported: {', '.join(widths)})"
                )
            if layer >= arch.num_layers:
                raise LoRAAdapterError(
                    f"LoRA adapter {name!r}: {key} is for layer {layer}, and the model has {arch.num_layers}"
                )
            if arch.layers[layer].moe is not None and module in ("gate_proj", "up_proj", "down_proj"):
                raise LoRAAdapterError(
                    f"LoRA adapter {name!r}: {key} targets layer {layer}'s MLP, a mixture of experts; adapters of "
                    "experts are not supported (attention projections are)"
                )
            in_features, out_features = widths[module]
            expected = [rank, in_features] if kind == "A" else [out_features, rank]
            shape = list(tensors.get_slice(key).get_shape())
            if shape != expected:
                raise LoRAAdapterError(
                    f"LoRA adapter {name!r}: {key} has shape {shape}, expected {expected} for this base model "
                    f"(rank {rank}): is it an adapter of another model?"
                )
            seen.setdefault((layer, module), set()).add(kind)
    if not seen:
        raise LoRAAdapterError(f"LoRA adapter {name!r}: {ADAPTER_WEIGHTS} holds no LoRA matrices")
    half = next(((layer, module) for (layer, module), kinds in seen.items() if kinds != {"A", "B"}), None)
    if half is not None:
        raise LoRAAdapterError(f"LoRA adapter {name!r}: layer {half[0]} {half[1]} has lora_A or lora_B, not both")
    return frozenset(module for _, module in seen)
