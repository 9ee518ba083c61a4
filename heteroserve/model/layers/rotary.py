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

from heteroserve.platforms.operators import OperatorTable


def inverse_frequencies(config: PretrainedConfig, head_dim: int) -> tuple[torch.Tensor, float]:
    """Frequencies and output scale for the config's rope type (transformers' formulas for scaled types)."""
    params = config.rope_parameters
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        base = params["rope_theta"]
        return 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim)), 1.0
    if rope_type == "dynamic" or rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"rope type {rope_type!r} is not supported")
    return ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))


class RotaryEmbedding(nn.Module):
    def __init__(self, config: PretrainedConfig, head_dim: int, max_positions: int, ops: OperatorTable) -> None:
        super().__init__()
        self.ops = ops
        inv_freq, scale = inverse_frequencies(config, head_dim)
        freqs = torch.arange(max_positions, dtype=torch.float)[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos() * scale, persistent=False)
        self.register_buffer("sin", emb.sin() * scale, persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, Hq, D], k: [T, Hkv, D]; rotate-half convention (Hugging Face layout)."""
        return self.ops.rotary(positions, q, k, self.cos, self.sin)


# Text models whose M-RoPE interleaves the axes (t, h, w, t, h, w, ...) instead of consecutive sections.
INTERLEAVED_MROPE = ("qwen3_vl_text",)


class MRotaryEmbedding(RotaryEmbedding):
    """M-RoPE: frequency column j reads position axis `axis_of_column[j]` (the config's `mrope_section`)."""

    def __init__(self, config: PretrainedConfig, head_dim: int, max_positions: int, ops: OperatorTable) -> None:
        super().__init__(config, head_dim, max_positions, ops)
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
    config: PretrainedConfig, head_dim: int, max_positions: int, ops: OperatorTable
) -> RotaryEmbedding:
    """M-RoPE where the config has an `mrope_section`, plain rotary otherwise."""
    if "mrope_section" in (getattr(config, "rope_parameters", None) or {}):
        return MRotaryEmbedding(config, head_dim, max_positions, ops)
    return RotaryEmbedding(config, head_dim, max_positions, ops)
