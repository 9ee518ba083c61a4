"""The vision tower of a Qwen-VL checkpoint as data: what differs between Qwen2-VL, Qwen2.5-VL and Qwen3-VL."""

from __future__ import annotations

from dataclasses import dataclass

from transformers import PretrainedConfig


@dataclass(frozen=True)
class VisionSpec:
    model_type: str
    depth: int
    embed_dim: int  # width of the vision blocks
    num_heads: int
    mlp_dim: int
    out_dim: int  # the language model's hidden size, what the patch merger outputs
    activation: str  # transformers' ACT2FN name of the block MLP
    gated_mlp: bool  # Qwen2.5-VL: gate/up/down projections; Qwen2-VL: fc1/fc2
    rms_norm: bool  # Qwen2.5-VL: RMSNorm in blocks and merger; Qwen2-VL: LayerNorm
    patch_size: int
    temporal_patch_size: int
    in_channels: int
    merge_size: int  # spatial_merge_size: merge_size x merge_size patches become one token
    rope_theta: float
    window_size: int | None  # in pixels (Qwen2.5-VL); None: every block attends over the whole image
    full_attention_blocks: tuple[int, ...]
    patch_bias: bool = False  # Qwen3-VL's patch embedding has a bias
    num_position_embeddings: int = 0  # Qwen3-VL: a learned square grid of positions, resized to each image
    deepstack_blocks: tuple[int, ...] = ()  # Qwen3-VL: blocks whose merged output feeds early decoder layers

    @property
    def head_dim(self) -> int:
        return self.embed_dim // self.num_heads

    @property
    def window_units(self) -> int | None:
        """Window side in merged tokens, as transformers computes it."""
        return None if self.window_size is None else self.window_size // self.merge_size // self.patch_size

    @classmethod
    def from_hf_config(cls, model_type: str, config: PretrainedConfig) -> VisionSpec:
        rope = getattr(config, "rope_parameters", None) or {}
        common = {
            "model_type": model_type,
            "depth": config.depth,
            "num_heads": config.num_heads,
            "activation": config.hidden_act,
            "patch_size": config.patch_size,
            "temporal_patch_size": config.temporal_patch_size,
            "in_channels": config.in_channels,
            "merge_size": config.spatial_merge_size,
            "rope_theta": rope.get("rope_theta", 10000.0),
        }
        if model_type == "qwen2_vl":
            return cls(
                embed_dim=config.embed_dim,
                mlp_dim=int(config.embed_dim * config.mlp_ratio),
                out_dim=config.hidden_size,
                gated_mlp=False,
                rms_norm=False,
                window_size=None,
                full_attention_blocks=(),
                **common,
            )
        if model_type == "qwen2_5_vl":
            return cls(
                embed_dim=config.hidden_size,
                mlp_dim=config.intermediate_size,
                out_dim=config.out_hidden_size,
                gated_mlp=True,
                rms_norm=True,
                window_size=config.window_size,
                full_attention_blocks=tuple(config.fullatt_block_indexes),
                **common,
            )
        if model_type == "qwen3_vl":
            return cls(
                embed_dim=config.hidden_size,
                mlp_dim=config.intermediate_size,
                out_dim=config.out_hidden_size,
                gated_mlp=False,
                rms_norm=False,
                window_size=None,
                full_attention_blocks=(),
                patch_bias=True,
                num_position_embeddings=config.num_position_embeddings,
                deepstack_blocks=tuple(config.deepstack_visual_indexes),
                **common,
            )
        raise ValueError(f"no vision tower for model type {model_type!r}")
