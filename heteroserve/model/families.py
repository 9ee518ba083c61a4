"""The decoder families we load, each as the blocks its layers use and its checkpoint's layout.

Adding a family is one entry in `FAMILIES`: a function of the transformers config that returns what differs from
Llama (`Family`). Everything else (the layer, the loader, the kernels' trait checks) derives from `ModelArch`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

from transformers.modeling_rope_utils import yarn_apply_mscale

from heteroserve.model.arch import (
    ROTARY_GLOBAL,
    ROTARY_LOCAL,
    ROTARY_NONE,
    CheckpointLayout,
    LayerSpec,
    MLASpec,
    ModelArch,
    MoESpec,
    RotarySpec,
)

# Vision-language model_type -> the family of its language model (its `text_config`).
VISION_LANGUAGE: dict[str, str] = {"qwen2_vl": "qwen2", "qwen2_5_vl": "qwen2", "qwen3_vl": "qwen3"}
SLIDING, FULL = "sliding_attention", "full_attention"
# Gemma 2/3 and OLMo 2 sandwich norms and GLM-4's post-norms, under our names (arch.py's layer order).
_GEMMA_NORMS = (
    ("post_attention_layernorm", "attn_output_norm"),
    ("pre_feedforward_layernorm", "post_attention_layernorm"),
    ("post_feedforward_layernorm", "mlp_output_norm"),
)


@dataclass(frozen=True)
class Family:
    """What a family changes from Llama: the layers' blocks (`layer(index)`), model-level steps, the checkpoint."""

    layer: Callable[[int], LayerSpec] = lambda index: LayerSpec()
    rotary: dict[str, RotarySpec] | None = None  # None: one global table over `partial_rotary_factor` of each head
    attn_scale: float | None = None  # None: head_dim ** -0.5
    embed_scale: float = 1.0
    logits_scale: float = 1.0
    final_softcap: float | None = None
    checkpoint: CheckpointLayout = field(default_factory=CheckpointLayout)
    # The KV cache's heads and head size where they are not the attention's (latent attention: one latent a token)
    kv_cache_heads: tuple[int, int] | None = None


def _windows(config, every_layer: bool = False) -> Callable[[int], int | None]:
    """Layer index -> its window: the config's `layer_types` choose (sliding_attention layers have it), or
    with `every_layer` all layers share `sliding_window` (Mistral, Phi-3)."""
    window = getattr(config, "sliding_window", None)
    if every_layer or window is None:
        return lambda index: window if every_layer else None
    types = getattr(config, "layer_types", None) or [FULL] * config.num_hidden_layers
    return lambda index: window if types[index] == SLIDING else None


def _llama(config) -> Family:
    bias = bool(getattr(config, "attention_bias", False))
    mlp_bias = bool(getattr(config, "mlp_bias", False))
    window = _windows(config)
    return Family(layer=lambda i: LayerSpec(sliding_window=window(i), qkv_bias=bias, o_bias=bias, mlp_bias=mlp_bias))


def _mistral(config) -> Family:
    window = _windows(config, every_layer=True)
    return Family(layer=lambda i: LayerSpec(sliding_window=window(i)))


def _qwen2(config) -> Family:
    window = _windows(config)
    return Family(layer=lambda i: LayerSpec(sliding_window=window(i), qkv_bias=True))


def _qwen3(config) -> Family:
    bias = bool(getattr(config, "attention_bias", False))
    window = _windows(config)
    return Family(layer=lambda i: LayerSpec(sliding_window=window(i), qkv_bias=bias, o_bias=bias, qk_norm="head"))


def _gemma_common(config, **layer) -> Callable[[int], LayerSpec]:
    act = _gelu_tanh(config, "hidden_activation")
    window = _windows(config)
    return lambda i: LayerSpec(sliding_window=window(i), activation=act, **layer)


def _gemma(config) -> Family:
    return Family(
        layer=lambda i: LayerSpec(activation=_gelu_tanh(config, "hidden_act")),
        embed_scale=config.hidden_size**0.5,
        checkpoint=CheckpointLayout(norm_offset=True),
    )


def _gemma2(config) -> Family:
    return Family(
        layer=_gemma_common(config, attn_softcap=config.attn_logit_softcapping, output_norms=True),
        attn_scale=config.query_pre_attn_scalar**-0.5,
        embed_scale=config.hidden_size**0.5,
        final_softcap=config.final_logit_softcapping,
        checkpoint=CheckpointLayout(renames=_GEMMA_NORMS, norm_offset=True),
    )


def _gemma3(config) -> Family:
    if getattr(config, "use_bidirectional_attention", False):
        raise ValueError(
            "gemma3_text with use_bidirectional_attention (EmbeddingGemma) attends in both directions; the decoder "
            "here attends causally only"
        )
    base = _gemma_common(config, attn_softcap=config.attn_logit_softcapping, output_norms=True, qk_norm="head")
    types = config.layer_types

    def layer(i: int) -> LayerSpec:
        return dataclasses.replace(base(i), rotary=ROTARY_LOCAL if types[i] == SLIDING else ROTARY_GLOBAL)

    return Family(
        layer=layer,
        rotary={ROTARY_GLOBAL: RotarySpec(config.head_dim, FULL), ROTARY_LOCAL: RotarySpec(config.head_dim, SLIDING)},
        attn_scale=config.query_pre_attn_scalar**-0.5,
        embed_scale=config.hidden_size**0.5,
        final_softcap=config.final_logit_softcapping,
        checkpoint=CheckpointLayout(renames=_GEMMA_NORMS, norm_offset=True),
    )


def _phi3(config) -> Family:
    window = _windows(config, every_layer=True)
    return Family(
        layer=lambda i: LayerSpec(sliding_window=window(i)),
        checkpoint=CheckpointLayout(fused_qkv="self_attn.qkv_proj", fused_gate_up="mlp.gate_up_proj"),
    )


def _glm(config) -> Family:
    bias = bool(config.attention_bias)
    return Family(
        layer=lambda i: LayerSpec(qkv_bias=bias),
        checkpoint=CheckpointLayout(fused_gate_up="mlp.gate_up_proj", interleaved_rotary=True),
    )


def _glm4(config) -> Family:
    bias = bool(config.attention_bias)
    return Family(
        layer=lambda i: LayerSpec(qkv_bias=bias, output_norms=True),
        checkpoint=CheckpointLayout(
            renames=(("post_self_attn_layernorm", "attn_output_norm"), ("post_mlp_layernorm", "mlp_output_norm")),
            fused_gate_up="mlp.gate_up_proj",
            interleaved_rotary=True,
        ),
    )


def _ernie4_5(config) -> Family:
    bias = bool(config.use_bias)
    return Family(
        layer=lambda i: LayerSpec(qkv_bias=bias, o_bias=bias, mlp_bias=bias),
        checkpoint=CheckpointLayout(interleaved_rotary=True),
    )


def _smollm3(config) -> Family:
    uses_rope = config.no_rope_layers
    window = _windows(config) if getattr(config, "use_sliding_window", False) else (lambda i: None)
    bias, mlp_bias = bool(config.attention_bias), bool(config.mlp_bias)

    def layer(i: int) -> LayerSpec:
        rotary = ROTARY_GLOBAL if uses_rope[i] else ROTARY_NONE
        return LayerSpec(sliding_window=window(i), rotary=rotary, qkv_bias=bias, o_bias=bias, mlp_bias=mlp_bias)

    return Family(layer=layer)


def _granite(config) -> Family:
    bias, mlp_bias = bool(config.attention_bias), bool(config.mlp_bias)
    residual = float(config.residual_multiplier)
    return Family(
        layer=lambda i: LayerSpec(qkv_bias=bias, o_bias=bias, mlp_bias=mlp_bias, residual_scale=residual),
        attn_scale=float(config.attention_multiplier),
        embed_scale=float(config.embedding_multiplier),
        logits_scale=1.0 / float(config.logits_scaling),
    )


def _olmo2(config) -> Family:
    bias = bool(getattr(config, "attention_bias", False))
    return Family(
        layer=lambda i: LayerSpec(qkv_bias=bias, o_bias=bias, qk_norm="projection", pre_norms=False, output_norms=True),
        checkpoint=CheckpointLayout(
            renames=(
                ("post_attention_layernorm", "attn_output_norm"),
                ("post_feedforward_layernorm", "mlp_output_norm"),
            )
        ),
    )


def _sparse_layers(config) -> Callable[[int], bool]:
    """Qwen-MoE's choice of the layers with experts: every `decoder_sparse_step`-th, except `mlp_only_layers`."""
    step, dense = config.decoder_sparse_step, set(config.mlp_only_layers)
    return lambda i: i not in dense and (i + 1) % step == 0


def _mixtral(config) -> Family:
    window = _windows(config, every_layer=True)
    moe = MoESpec(config.num_local_experts, config.num_experts_per_tok, config.intermediate_size)
    return Family(
        layer=lambda i: LayerSpec(sliding_window=window(i), moe=moe),
        checkpoint=CheckpointLayout(renames=(("block_sparse_moe", "mlp"),), expert_projections=("w1", "w3", "w2")),
    )


def _qwen2_moe(config) -> Family:
    window, sparse = _windows(config), _sparse_layers(config)
    moe = MoESpec(
        config.num_experts,
        config.num_experts_per_tok,
        config.moe_intermediate_size,
        renormalize=config.norm_topk_prob,
        shared_intermediate_size=config.shared_expert_intermediate_size,
        shared_gate=True,
    )
    bias = bool(getattr(config, "qkv_bias", True))
    return Family(
        layer=lambda i: LayerSpec(sliding_window=window(i), qkv_bias=bias, moe=moe if sparse(i) else None),
        checkpoint=CheckpointLayout(renames=(("mlp.shared_expert", "mlp.shared_experts"),)),
    )


def _qwen3_moe(config) -> Family:
    dense = _qwen3(config).layer
    sparse = _sparse_layers(config)
    moe = MoESpec(
        config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size, renormalize=config.norm_topk_prob
    )
    return Family(layer=lambda i: dataclasses.replace(dense(i), moe=moe if sparse(i) else None))


def _ernie4_5_moe(config) -> Family:
    dense = _ernie4_5(config)
    first, last, step = config.moe_layer_start_index, config.moe_layer_end_index, config.moe_layer_interval
    moe = MoESpec(
        config.moe_num_experts,
        config.moe_k,
        config.moe_intermediate_size,
        correction_bias=True,
        shared_intermediate_size=config.moe_intermediate_size * config.moe_num_shared_experts,
    )

    if config.use_bias and config.moe_num_shared_experts:
        raise ValueError("ernie4_5_moe with use_bias: biases on the shared experts are not implemented")

    def layer(i: int) -> LayerSpec:
        if (i + 1) % step == 0 and first <= i <= last:  # the routed experts have no biases
            return dataclasses.replace(dense.layer(i), moe=moe, mlp_bias=False)
        return dense.layer(i)

    return dataclasses.replace(
        dense,
        layer=layer,
        checkpoint=dataclasses.replace(dense.checkpoint, renames=(("mlp.moe_statics", "mlp.gate"),)),
    )


def _glm4_moe(config) -> Family:
    bias = bool(config.attention_bias)
    moe = MoESpec(
        config.n_routed_experts,
        config.num_experts_per_tok,
        config.moe_intermediate_size,
        scoring="sigmoid",
        renormalize=config.norm_topk_prob,
        correction_bias=True,
        num_groups=config.n_group,
        top_groups=config.topk_group,
        routed_scale=float(config.routed_scaling_factor),
        shared_intermediate_size=config.moe_intermediate_size * config.n_shared_experts,
    )
    qk_norm = "head" if config.use_qk_norm else None

    def layer(i: int) -> LayerSpec:
        return LayerSpec(qkv_bias=bias, qk_norm=qk_norm, moe=moe if i >= config.first_k_dense_replace else None)

    return Family(
        layer=layer, checkpoint=CheckpointLayout(extra_layers=getattr(config, "num_nextn_predict_layers", 0) or 0)
    )


def _deepseek(config) -> Family:
    """DeepSeek-V2 (softmax scores, greedy or group-limited by each group's best expert) and V3 / Kimi K2
    (sigmoid scores with a correction bias, groups by their two best): latent attention, shared experts, dense
    layers before `first_k_dense_replace`, rotary pairs adjacent (V2 always, V3 where `rope_interleave`)."""
    if config.attention_bias:
        raise ValueError(f"{config.model_type} with attention_bias: biases in latent attention are not implemented")
    v3 = config.model_type == "deepseek_v3"
    mla = MLASpec(
        config.q_lora_rank, config.kv_lora_rank, config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
    )
    routing: dict = {"scoring": "sigmoid", "correction_bias": True} if v3 else {"group_score": "max"}
    if not v3 and config.topk_method not in ("greedy", "group_limited_greedy"):
        raise ValueError(f"deepseek_v2 topk_method {config.topk_method!r} is not implemented")
    grouped = v3 or config.topk_method == "group_limited_greedy"
    moe = MoESpec(
        config.n_routed_experts,
        config.num_experts_per_tok,
        config.moe_intermediate_size,
        renormalize=bool(config.norm_topk_prob),
        num_groups=config.n_group if grouped else 1,
        top_groups=config.topk_group if grouped else 1,
        routed_scale=float(config.routed_scaling_factor),
        shared_intermediate_size=config.moe_intermediate_size * config.n_shared_experts,
        **routing,
    )
    first_moe = config.first_k_dense_replace
    qk_scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    return Family(
        layer=lambda i: LayerSpec(mla=mla, moe=moe if i >= first_moe else None),
        rotary={ROTARY_GLOBAL: RotarySpec(config.qk_rope_head_dim)},
        attn_scale=yarn_apply_mscale(config.rope_parameters, qk_scale),
        checkpoint=CheckpointLayout(
            interleaved_rotary=not v3 or bool(getattr(config, "rope_interleave", True)),
            extra_layers=getattr(config, "num_nextn_predict_layers", 0) or 0,
        ),
        kv_cache_heads=(1, config.kv_lora_rank + config.qk_rope_head_dim),
    )


def _gpt_oss(config) -> Family:
    """gpt-oss: alternating 128-token windows, attention sinks, biases on every projection, experts with biases
    and a clamped SwiGLU, chosen by the top-k of the router's logits (softmax over those k: the same weights as
    renormalising the softmax over all experts)."""
    window = _windows(config)
    moe = MoESpec(
        config.num_local_experts,
        config.num_experts_per_tok,
        config.intermediate_size,
        router_bias=True,
        expert_bias=True,
        swiglu_limit=float(config.swiglu_limit),
        swiglu_alpha=float(config.swiglu_alpha),
    )
    bias = bool(config.attention_bias)
    return Family(
        layer=lambda i: LayerSpec(sliding_window=window(i), qkv_bias=bias, o_bias=bias, attn_sinks=True, moe=moe),
        checkpoint=CheckpointLayout(renames=(("mlp.router", "mlp.gate"),), stacked_experts=True),
    )


def _gelu_tanh(config, key: str) -> str:
    act = getattr(config, key, None) or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_new", "gelu_fast"):
        raise ValueError(f"unsupported {key} {act!r} for {config.model_type}; implemented: gelu_pytorch_tanh")
    return "gelu_tanh"


FAMILIES: dict[str, Callable[..., Family]] = {
    "llama": _llama,
    "mistral": _mistral,
    "qwen2": _qwen2,
    "qwen3": _qwen3,
    "gemma": _gemma,
    "gemma2": _gemma2,
    "gemma3_text": _gemma3,
    "phi3": _phi3,
    "glm": _glm,
    "glm4": _glm4,
    "ernie4_5": _ernie4_5,
    "smollm3": _smollm3,
    "granite": _granite,
    "olmo2": _olmo2,
    "mixtral": _mixtral,
    "qwen2_moe": _qwen2_moe,
    "qwen3_moe": _qwen3_moe,
    "ernie4_5_moe": _ernie4_5_moe,
    "glm4_moe": _glm4_moe,
    "deepseek_v2": _deepseek,
    "deepseek_v3": _deepseek,
    "gpt_oss": _gpt_oss,
}


def supported_model_types() -> list[str]:
    return [*FAMILIES, *VISION_LANGUAGE]


def arch_of(config) -> ModelArch:
    """The `ModelArch` of a transformers config (a vision-language model's: its language model's)."""
    model_type = config.model_type
    if model_type not in FAMILIES and model_type not in VISION_LANGUAGE:
        raise ValueError(
            f"unsupported architecture {model_type!r} ({getattr(config, 'architectures', None)}); "
            f"supported: {', '.join(supported_model_types())}"
        )
    tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
    family_name = VISION_LANGUAGE.get(model_type, model_type)
    if model_type in VISION_LANGUAGE:
        config = config.get_text_config()
    family = FAMILIES[family_name](config)
    act = getattr(config, "hidden_act", "silu")
    if family_name not in ("gemma", "gemma2", "gemma3_text") and act != "silu":
        raise ValueError(f"unsupported activation {act!r} for {family_name}; implemented: silu")
    num_heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
    num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
    if family.kv_cache_heads is not None:
        num_kv_heads, head_dim = family.kv_cache_heads
    rotary = family.rotary
    if rotary is None:
        factor = (getattr(config, "rope_parameters", None) or {}).get("partial_rotary_factor", 1.0)
        rotary = {ROTARY_GLOBAL: RotarySpec(int(head_dim * factor))}
    layers = tuple(family.layer(i) for i in range(config.num_hidden_layers))
    positions, context_limit = config.max_position_embeddings, None
    params = getattr(config, "rope_parameters", None) or {}
    if params.get("rope_type") == "dynamic":  # InternLM2, some Llama fine-tunes
        positions = params.get("original_max_position_embeddings") or positions
        context_limit = (
            "dynamic NTK rope scaling, which transformers applies past the original context by rescaling every "
            "position of the sequence as it grows, is not implemented (within it the frequencies are the default)"
        )
    if params.get("rope_type") == "longrope":  # Phi-3.5, Phi-4-mini
        positions = params["original_max_position_embeddings"]
        context_limit = (
            f"LongRoPE's long factors, which transformers and vLLM switch every position of a sequence to once it "
            f"passes the original {positions} positions, are not implemented (the short factors hold up to there)"
        )
    if any(layer.rotary == ROTARY_NONE for layer in layers):
        rotary = {**rotary, ROTARY_NONE: RotarySpec(0)}
    for spec in rotary.values():
        if spec.rotary_dim % 2 or spec.rotary_dim > head_dim:
            raise ValueError(f"rotary dimension {spec.rotary_dim} must be even and at most head_dim {head_dim}")
    return ModelArch(
        model_type=model_type,
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        num_layers=config.num_hidden_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        intermediate_size=config.intermediate_size,
        rms_norm_eps=config.rms_norm_eps,
        tie_word_embeddings=tie_word_embeddings,
        max_position_embeddings=positions,
        layers=layers,
        rotary=rotary,
        attn_scale=family.attn_scale if family.attn_scale is not None else head_dim**-0.5,
        embed_scale=family.embed_scale,
        logits_scale=family.logits_scale,
        final_softcap=family.final_softcap,
        checkpoint=family.checkpoint,
        context_limit=context_limit,
        values_in_keys=family.kv_cache_heads is not None,
    )
