"""Rotary position embedding: a precomputed cos/sin table, applied by the platform's `rotary` operator.

Vision-language models (Qwen2-VL family) use M-RoPE: each token has three positions (temporal, height,
width) and each rotary frequency reads one of them. Text tokens have three equal positions, so a batch
without images passes plain [T] positions and costs exactly what a text model's does.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from heteroserve.model.arch import RotarySpec
from heteroserve.platforms.operators import OperatorTable


def rope_parameters(config: PretrainedConfig, spec: RotarySpec) -> dict:
    return config.rope_parameters if spec.layer_type is None else config.rope_parameters[spec.layer_type]


def inverse_frequencies(config: PretrainedConfig, spec: RotarySpec) -> tuple[torch.Tensor, float]:
    """The spec's rotary_dim / 2 frequencies and output scale for the config's rope type (transformers' formulas
    for scaled types; LongRoPE's short factors, which hold within its original context: families.py holds such a
    model's context to it)."""
    if spec.rotary_dim == 0:
        return torch.zeros(0), 1.0
    params = rope_parameters(config, spec)
    rope_type = params.get("rope_type", "default")
    # Dynamic NTK keeps the default frequencies within the original context (families.py holds the context to
    # it): past it, it would rescale every position of a sequence as the sequence grows, which no table can.
    if rope_type in ("default", "dynamic"):
        base, dim = params["rope_theta"], spec.rotary_dim
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        divisors = getattr(config, "rope_frequency_divisors", None)  # a GGUF file's rope_freqs (gguf_loader.py)
        if divisors is not None:
            if len(divisors) != inv_freq.numel():
                raise ValueError(f"rope_freqs has {len(divisors)} factors for {inv_freq.numel()} rotary frequencies")
            inv_freq = inv_freq / torch.tensor(divisors, dtype=torch.float)
        return inv_freq, 1.0
    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"rope type {rope_type!r} is not supported")
    kwargs = {} if spec.layer_type is None else {"layer_type": spec.layer_type}
    inv_freq, scale = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"), **kwargs)
    if inv_freq.numel() != spec.rotary_dim // 2:
        raise ValueError(
            f"rope type {rope_type!r} gave {inv_freq.numel()} frequencies for {spec.rotary_dim} dimensions"
        )
    return inv_freq, scale


class RotaryEmbedding(nn.Module):
    """cos/sin tables [max_positions, head_dim] in rotate-half layout: column j pairs with j + head_dim / 2. With
    partial rotary the first rotary_dim / 2 columns of each half rotate and the rest have cos 1, sin 0 (the loader
    orders q/k rows to match: ModelArch.qk_row_order); rotary_dim 0 is a layer without position encoding."""

    def __init__(
        self, config: PretrainedConfig, spec: RotarySpec, head_dim: int, max_positions: int, ops: OperatorTable
    ) -> None:
        super().__init__()
        self.ops = ops
        inv_freq, scale = inverse_frequencies(config, spec)
        freqs = torch.arange(max_positions, dtype=torch.float)[:, None] * inv_freq[None, :]
        cos = torch.ones(max_positions, head_dim // 2)
        sin = torch.zeros(max_positions, head_dim // 2)
        cos[:, : inv_freq.numel()] = freqs.cos() * scale
        sin[:, : inv_freq.numel()] = freqs.sin() * scale
        self.register_buffer("cos", torch.cat((cos, cos), dim=-1), persistent=False)
        self.register_buffer("sin", torch.cat((sin, sin), dim=-1), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, Hq, D], k: [T, Hkv, D]; rotate-half convention (Hugging Face layout)."""
        return self.ops.rotary(positions, q, k, self.cos, self.sin)


# Text models whose M-RoPE interleaves the axes (t, h, w, t, h, w, ...) instead of consecutive sections.
INTERLEAVED_MROPE = ("qwen3_vl_text",)


class MRotaryEmbedding(RotaryEmbedding):
    """M-RoPE: frequency column j reads position axis `axis_of_column[j]` (the config's `mrope_section`)."""

    def __init__(
        self, config: PretrainedConfig, spec: RotarySpec, head_dim: int, max_positions: int, ops: OperatorTable
    ) -> None:
        super().__init__(config, spec, head_dim, max_positions, ops)
        sections = list(config.rope_parameters["mrope_section"])
        if sum(sections) != head_dim // 2 or len(sections) != 3:
            raise ValueError(
                f"mrope_section {sections} must be three sizes adding up to head_dim / 2 = {head_dim // 2}"
            )
        interleaved = config.rope_parameters.get("mrope_interleaved") or config.model_type in INTERLEAVED_MROPE
        if interleaved:  # column j reads axis j % 3 while that axis has columns left, else the temporal one
            columns = torch.arange(head_dim // 2)
            half = torch.zeros(head_dim // 2, dtype=torch.long)
            for axis in (1, 2):
                half[(columns % 3 == axis) & (columns < 3 * sections[axis])] = axis
        else:
            half = torch.cat([torch.full((size,), axis) for axis, size in enumerate(sections)])
        self.register_buffer("axis_of_column", torch.cat((half, half)), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [T] (text only: all three axes equal) or [3, T] (temporal, height, width)."""
        if positions.dim() == 1:
            return super().forward(positions, q, k)
        index = self.axis_of_column[None, None, :].expand(1, positions.shape[1], -1)
        cos = self.cos[positions].gather(0, index)[0]  # [T, D]: column j from axis axis_of_column[j]
        sin = self.sin[positions].gather(0, index)[0]
        rows = torch.arange(positions.shape[1], device=positions.device)
        return self.ops.rotary(rows, q, k, cos, sin)


def rotary_embedding(
    config: PretrainedConfig, spec: RotarySpec, head_dim: int, max_positions: int, ops: OperatorTable
) -> RotaryEmbedding:
    """M-RoPE where the config has an `mrope_section`, plain rotary otherwise."""
    if "mrope_section" in (getattr(config, "rope_parameters", None) or {}):
        return MRotaryEmbedding(config, spec, head_dim, max_positions, ops)
    return RotaryEmbedding(config, spec, head_dim, max_positions, ops)
