"""The architecture of a decoder-only model as data: what differs between Llama, Mistral and Qwen."""

from __future__ import annotations

from dataclasses import dataclass

from transformers import PretrainedConfig

# model_type -> how it differs from plain Llama.
ARCHITECTURES: dict[str, dict[str, bool]] = {
    "llama": {},
    "mistral": {"sliding_window": True},
    "qwen2": {"qkv_bias": True},
    "qwen3": {"qk_norm": True},
}
# Vision-language model_type -> the text architecture of its language model (its `text_config`).
VISION_LANGUAGE: dict[str, str] = {"qwen2_vl": "qwen2", "qwen2_5_vl": "qwen2", "qwen3_vl": "qwen3"}


@dataclass(frozen=True)
class ModelArch:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    sliding_window: int | None
    max_position_embeddings: int

    @classmethod
    def from_hf_config(cls, config: PretrainedConfig) -> ModelArch:
        """The decoder of a text model, or the language model of a vision-language one."""
        model_type = config.model_type
        if model_type not in ARCHITECTURES and model_type not in VISION_LANGUAGE:
            raise ValueError(
                f"unsupported architecture {model_type!r} ({getattr(config, 'architectures', None)}); "
                f"supported: {', '.join([*ARCHITECTURES, *VISION_LANGUAGE])}"
            )
        traits = ARCHITECTURES[VISION_LANGUAGE.get(model_type, model_type)]
        tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if model_type in VISION_LANGUAGE:
            config = config.get_text_config()
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported activation {config.hidden_act!r}; only silu is implemented")
        num_heads = config.num_attention_heads
        window = getattr(config, "sliding_window", None) if traits.get("sliding_window") else None
        return cls(
            model_type=model_type,
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            num_layers=config.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // num_heads,
            intermediate_size=config.intermediate_size,
            rms_norm_eps=config.rms_norm_eps,
            tie_word_embeddings=tie_word_embeddings,
            qkv_bias=traits.get("qkv_bias", False) or bool(getattr(config, "attention_bias", False)),
            qk_norm=traits.get("qk_norm", False),
            sliding_window=window,
            max_position_embeddings=config.max_position_embeddings,
        )
