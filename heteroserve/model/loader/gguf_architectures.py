"""llama.cpp's architectures as data: which of our families a GGUF `general.architecture` is, and what llama.cpp's
convert_hf_to_gguf.py did to the Hugging Face checkpoint, so that loading undoes it.

The GGUF path hands canonical_tensors what a Hugging Face checkpoint of the family would: its tensor names, its
row order and its norm convention. Per architecture: the transformers model_type, the config fields its
`<arch>.*` keys carry beyond the common ones, its layer-tensor names, and the converter's transforms:
- `permuted_qk`: Llama-derived converters permute q/k rows and biases for llama.cpp's adjacent-pair rotary;
- `norm_offset`: Gemma converters add 1 to every norm weight (Gemma scales by 1 + w); it is subtracted, since
  our Gemma layout adds it at load;
- `split_qkv`: a fused `attn_qkv` is split here where the family's layout has no fused q/k/v (Qwen, ChatGLM);
  Phi-3's is renamed to the fused name its layout splits. A fused gate/up is llama.cpp's `ffn_up`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from heteroserve.model.families import FULL, SLIDING


@dataclass(frozen=True)
class Metadata:
    """A file's `<arch>.*` keys (without the prefix), its tensor names and the common config fields built so far."""

    get: Callable[[str, object], object]
    tensor_names: frozenset[str]
    common: dict

    def has_tensor(self, layer_tensor: str) -> bool:
        return f"blk.0.{layer_tensor}" in self.tensor_names


_LLAMA_LAYER = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_SANDWICH_LAYER = {  # Gemma 2/3 (OLMo 2 has no attn_norm / ffn_norm)
    **_LLAMA_LAYER,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_FUSED_GATE_UP_LAYER = {**_LLAMA_LAYER, "ffn_up": "mlp.gate_up_proj"}
_GLM4_LAYER = {
    **_FUSED_GATE_UP_LAYER,
    "post_attention_norm": "post_self_attn_layernorm",
    "post_ffw_norm": "post_mlp_layernorm",
}
GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def _none(meta: Metadata) -> dict:
    return {}


@dataclass(frozen=True)
class GGUFArchitecture:
    model_type: str  # our family (families.py)
    config: Callable[[Metadata], dict] = _none  # family-specific config fields from the metadata
    layer_tensors: dict[str, str] = field(default_factory=lambda: _LLAMA_LAYER)
    permuted_qk: bool = False
    norm_offset: float = 0.0
    split_qkv: bool = False


def _biases(meta: Metadata, key: str = "attention_bias") -> dict:
    return {key: meta.has_tensor("attn_q.bias") or meta.has_tensor("attn_qkv.bias")}


def _mistral(meta: Metadata) -> dict:
    return {"sliding_window": meta.get("attention.sliding_window", None)}


def _no_window(meta: Metadata) -> dict:
    return {"use_sliding_window": False}


def _qwen(meta: Metadata) -> dict:
    """The original Qwen runs as Qwen2: feed_forward_length counts w1 and w2 together (each has half)."""
    return {"intermediate_size": meta.common["intermediate_size"] // 2, "use_sliding_window": False}


def _layer_types(meta: Metadata, default_pattern: int) -> list[str]:
    """llama.cpp's sliding-window layers: a bool per layer, or a period whose last layer attends fully."""
    layers = meta.common["num_hidden_layers"]
    pattern = meta.get("attention.sliding_window_pattern", default_pattern)
    if isinstance(pattern, list):
        return [SLIDING if swa else FULL for swa in pattern]
    return [SLIDING if i % pattern < pattern - 1 else FULL for i in range(layers)]


def _query_scalar(meta: Metadata, layers_27b: int) -> int:
    """llama.cpp scales queries by head_dim ** -0.5, except in the 27B models (hidden / heads): GGUF has no key."""
    common = meta.common
    if common["num_hidden_layers"] == layers_27b:
        return common["hidden_size"] // common["num_attention_heads"]
    return common["head_dim"]


def _gemma(meta: Metadata) -> dict:
    return {"hidden_activation": "gelu_pytorch_tanh"}


def _gemma2(meta: Metadata) -> dict:
    return {
        "hidden_activation": "gelu_pytorch_tanh",
        "sliding_window": meta.get("attention.sliding_window", 4096),
        "layer_types": _layer_types(meta, 2),
        "attn_logit_softcapping": meta.get("attn_logit_softcapping", None),
        "final_logit_softcapping": meta.get("final_logit_softcapping", None),
        "query_pre_attn_scalar": _query_scalar(meta, 46),
    }


def _gemma3(meta: Metadata) -> dict:
    window = meta.get("attention.sliding_window", None)
    layers = meta.common["num_hidden_layers"]
    return {
        "hidden_activation": "gelu_pytorch_tanh",
        "sliding_window": window or 4096,
        "layer_types": _layer_types(meta, 6) if window else [FULL] * layers,
        "final_logit_softcapping": meta.get("final_logit_softcapping", None),
        "attn_logit_softcapping": None,
        "query_pre_attn_scalar": _query_scalar(meta, 62),
        "rope_parameters": {
            FULL: meta.common["rope_parameters"],
            SLIDING: {"rope_type": "default", "rope_theta": meta.get("rope.freq_base_swa", 10000.0)},
        },
    }


def _phi3(meta: Metadata) -> dict:
    if "rope_factors_long.weight" in meta.tensor_names:
        raise ValueError("GGUF tensors rope_factors_long / rope_factors_short (Phi-3 LongRoPE) are not supported")
    original = meta.get("rope.scaling.original_context_length", None)
    return {
        "sliding_window": meta.get("attention.sliding_window", None),
        **({"original_max_position_embeddings": original} if original else {}),
    }


def _granite(meta: Metadata) -> dict:
    return {
        "attention_bias": meta.has_tensor("attn_q.bias"),
        "mlp_bias": meta.has_tensor("ffn_up.bias"),
        "attention_multiplier": meta.get("attention.scale", 1.0),
        "embedding_multiplier": meta.get("embedding_scale", 1.0),
        "residual_multiplier": meta.get("residual_scale", 1.0),
        "logits_scaling": meta.get("logit_scale", 1.0),
    }


def _smollm3(meta: Metadata) -> dict:
    """llama.cpp's SmolLM3 skips the rotary on every fourth layer; GGUF has no key for it."""
    layers = meta.common["num_hidden_layers"]
    return {
        "no_rope_layers": [int((i + 1) % 4 != 0) for i in range(layers)],
        "use_sliding_window": False,
        "attention_bias": meta.has_tensor("attn_q.bias"),
        "mlp_bias": meta.has_tensor("ffn_up.bias"),
    }


ARCHITECTURES: dict[str, GGUFArchitecture] = {
    "llama": GGUFArchitecture("llama", _biases, permuted_qk=True),
    "mistral": GGUFArchitecture("mistral", _mistral, permuted_qk=True),
    "qwen2": GGUFArchitecture("qwen2", _no_window),
    "qwen3": GGUFArchitecture("qwen3", _no_window),
    "qwen": GGUFArchitecture("qwen2", _qwen, split_qkv=True),
    "gemma": GGUFArchitecture("gemma", _gemma, norm_offset=1.0),
    "gemma2": GGUFArchitecture("gemma2", _gemma2, _SANDWICH_LAYER, norm_offset=1.0),
    "gemma3": GGUFArchitecture("gemma3_text", _gemma3, _SANDWICH_LAYER, norm_offset=1.0),
    "phi3": GGUFArchitecture("phi3", _phi3, {**_FUSED_GATE_UP_LAYER, "attn_qkv": "self_attn.qkv_proj"}),
    "chatglm": GGUFArchitecture("glm", _biases, _FUSED_GATE_UP_LAYER, split_qkv=True),
    "glm4": GGUFArchitecture("glm4", _biases, _GLM4_LAYER),
    "ernie4_5": GGUFArchitecture("ernie4_5", lambda meta: _biases(meta, "use_bias")),
    "smollm3": GGUFArchitecture("smollm3", _smollm3, permuted_qk=True),
    "granite": GGUFArchitecture("granite", _granite, permuted_qk=True),
    "olmo2": GGUFArchitecture("olmo2", _biases, _SANDWICH_LAYER),
}


def gguf_architecture(name: str) -> GGUFArchitecture:
    if name not in ARCHITECTURES:
        raise ValueError(f"unsupported GGUF architecture {name!r}; supported: {', '.join(ARCHITECTURES)}")
    return ARCHITECTURES[name]
