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

Mixtures of experts: llama.cpp stacks a layer's experts into 3-D tensors (`ffn_{gate,up,down}_exps`, gate and up
fused in `ffn_gate_up_exps` where the converter was asked to), which gguf_loader.py splits into one weight per
expert; its router is `ffn_gate_inp`. Which layers hold experts is read from where the routers are, and the
experts' sizes from the tensors' shapes (ERNIE's converter writes a shared-expert length of its own guessing).
An architecture whose dense files may also carry experts (Llama's, for Mixtral) names its `with_experts` variant.

DeepSeek-V2/V3 (`deepseek2`): latent attention's kv_b_proj is written split per head into `attn_k_b` (each head's
key rows transposed) and `attn_v_b`, which gguf_loader.py joins back; the file's KV head is the latent's one and
its key length the latent's, so the heads' sizes come from the `*_mla` keys. Softmax scores make it a DeepSeek-V2
(groups scored by their best expert), sigmoid scores a V3 (by their two best). Its YaRN keeps one mscale
(`yarn_log_multiplier` = 0.1 * mscale_all_dim), so the cached rotary tables are unscaled, as llama.cpp computes them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from heteroserve.model.families import FULL, SLIDING


@dataclass(frozen=True)
class Metadata:
    """A file's `<arch>.*` keys (without the prefix), its tensor names (and shapes) and the common config fields
    built so far."""

    get: Callable[[str, object], object]
    tensor_names: frozenset[str]
    common: dict
    tensor_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)  # torch order

    def has_tensor(self, layer_tensor: str) -> bool:
        return f"blk.0.{layer_tensor}" in self.tensor_names

    def layers_with(self, layer_tensor: str) -> list[int]:
        """The blocks that hold `layer_tensor` (e.g. a router), in order."""
        blocks = (name.split(".")[1] for name in self.tensor_names if name.endswith(f".{layer_tensor}"))
        return sorted(int(b) for b in blocks)


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
_MOE_LAYER = {
    **_LLAMA_LAYER,
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
    "ffn_up_shexp": "mlp.shared_experts.up_proj",
    "ffn_down_shexp": "mlp.shared_experts.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
_GLM4_MOE_LAYER = {**_MOE_LAYER, "post_attention_norm": "post_attention_layernorm"}
_DEEPSEEK2_LAYER = {
    **_MOE_LAYER,
    "attn_q_a": "self_attn.q_a_proj",
    "attn_q_a_norm": "self_attn.q_a_layernorm",
    "attn_q_b": "self_attn.q_b_proj",
    "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
    "attn_kv_a_norm": "self_attn.kv_a_layernorm",
    "attn_kv_b": "self_attn.kv_b_proj",  # older converters' (newer ones split it: LATENT_KEYS, LATENT_VALUES)
}
# llama.cpp's per-head halves of latent attention's kv_b_proj: keys [heads, kv_lora_rank, nope] and values
# [heads, v, kv_lora_rank] (torch order), joined back by gguf_loader.py into what attn_kv_b names.
LATENT_KEYS, LATENT_VALUES, LATENT_KV_B = "attn_k_b", "attn_v_b", "attn_kv_b"
GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# llama.cpp's expert stacks -> the projections of each expert they hold, in row order.
EXPERT_STACKS = {
    "ffn_gate_exps": ("gate_proj",),
    "ffn_up_exps": ("up_proj",),
    "ffn_down_exps": ("down_proj",),
    "ffn_gate_up_exps": ("gate_proj", "up_proj"),
}
# The router's correction bias (DeepSeek-V3, GLM-4.5, ERNIE 4.5): llama.cpp's exp_probs_b.bias.
CORRECTION_BIAS = ("exp_probs_b", "mlp.gate.e_score_correction_bias")


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
    moe: bool = False  # its layers may hold experts
    with_experts: GGUFArchitecture | None = None  # the variant a file with `<arch>.expert_count` is
    yarn: bool = False  # its converter's YaRN keys are read (config adds what else the family needs of them)


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


@dataclass(frozen=True)
class Experts:
    """A file's mixture of experts: the model's blocks with a router (multi-token-prediction blocks past
    `num_layers` aside), and the sizes read from the first one's tensors."""

    layers: list[int]
    count: int
    used: int
    intermediate: int  # one expert's
    shared_intermediate: int  # all shared experts together (0: none)

    @classmethod
    def of(cls, meta: Metadata, num_layers: int | None = None) -> Experts:
        num_layers = meta.common["num_hidden_layers"] if num_layers is None else num_layers
        layers = [i for i in meta.layers_with("ffn_gate_inp.weight") if i < num_layers]
        count, used = meta.get("expert_count", 0), meta.get("expert_used_count", 0)
        if not (layers and count and used):
            raise ValueError("GGUF file has no experts (expert_count, expert_used_count, ffn_gate_inp tensors)")
        shapes, first = meta.tensor_shapes, f"blk.{layers[0]}."
        down = shapes.get(first + "ffn_down_exps.weight")
        if down is None or down[0] != count:
            raise ValueError(f"GGUF block {layers[0]} has no ffn_down_exps stack of {count} experts")
        shared = shapes.get(first + "ffn_down_shexp.weight", (0, 0))[1]
        return cls(layers, count, used, down[2], shared)

    def shared_count(self) -> int:
        """Shared experts of one expert's size each (ERNIE 4.5, GLM-4.5)."""
        if self.shared_intermediate % self.intermediate:
            raise ValueError(
                f"GGUF shared experts of {self.shared_intermediate} rows are not a whole number of {self.intermediate}"
            )
        return self.shared_intermediate // self.intermediate

    def check_layers(self, expected: list[int], how: str) -> None:
        if self.layers != expected:
            raise ValueError(f"GGUF blocks with experts {self.layers} are not {how}'s {expected}")


def _mixtral(meta: Metadata) -> dict:
    experts = Experts.of(meta)
    experts.check_layers(list(range(meta.common["num_hidden_layers"])), "Mixtral (every layer)")
    return {
        "num_local_experts": experts.count,
        "num_experts_per_tok": experts.used,
        "intermediate_size": experts.intermediate,
        "sliding_window": meta.get("attention.sliding_window", None),
    }


def _qwen_moe(meta: Metadata, normalize: bool) -> dict:
    """Layers without a router are Qwen-MoE's `mlp_only_layers`. llama.cpp renormalises the top-k weights of
    Qwen3-MoE and not of Qwen2-MoE unless `expert_weights_norm` says otherwise."""
    experts = Experts.of(meta)
    layers = meta.common["num_hidden_layers"]
    return {
        "num_experts": experts.count,
        "num_experts_per_tok": experts.used,
        "moe_intermediate_size": experts.intermediate,
        "shared_expert_intermediate_size": experts.shared_intermediate,
        "norm_topk_prob": bool(meta.get("expert_weights_norm", normalize)),
        "decoder_sparse_step": 1,
        "mlp_only_layers": [i for i in range(layers) if i not in experts.layers],
        "use_sliding_window": False,
    }


def _qwen2_moe(meta: Metadata) -> dict:
    return {**_qwen_moe(meta, normalize=False), "qkv_bias": meta.has_tensor("attn_q.bias")}


def _qwen3_moe(meta: Metadata) -> dict:
    return {**_qwen_moe(meta, normalize=True), **_biases(meta)}


def _ernie4_5_moe(meta: Metadata) -> dict:
    """ERNIE 4.5's experts sit on every `interleave_moe_layer_step`-th layer from the first one with a router."""
    experts = Experts.of(meta)
    first, last, step = experts.layers[0], experts.layers[-1], meta.get("interleave_moe_layer_step", 1)
    experts.check_layers([i for i in range(first, last + 1) if (i + 1) % step == 0], f"ERNIE 4.5 (step {step})")
    return {
        **_biases(meta, "use_bias"),
        "moe_num_experts": experts.count,
        "moe_k": experts.used,
        "moe_intermediate_size": experts.intermediate,
        "moe_num_shared_experts": experts.shared_count(),
        "moe_layer_start_index": first,
        "moe_layer_end_index": last,
        "moe_layer_interval": step,
    }


_SIGMOID = 2  # llama.cpp's expert_gating_func for sigmoid scores (gguf.ExpertGatingFuncType)


def _glm4_moe(meta: Metadata) -> dict:
    """GLM-4.5: dense leading layers, sigmoid scores; multi-token-prediction blocks are counted in block_count."""
    if meta.get("expert_gating_func", _SIGMOID) != _SIGMOID:
        raise ValueError("GGUF key glm4moe.expert_gating_func: GLM-4.5's experts are scored by sigmoid here")
    nextn = meta.get("nextn_predict_layers", 0)
    layers = meta.common["num_hidden_layers"] - nextn
    experts = Experts.of(meta, layers)
    dense = meta.get("leading_dense_block_count", 0)
    experts.check_layers(list(range(dense, layers)), f"GLM-4.5 (after {dense} dense ones)")
    return {
        **_biases(meta),
        "num_hidden_layers": layers,
        "num_nextn_predict_layers": nextn,
        "use_qk_norm": meta.has_tensor("attn_q_norm.weight"),
        "n_routed_experts": experts.count,
        "num_experts_per_tok": experts.used,
        "moe_intermediate_size": experts.intermediate,
        "n_shared_experts": experts.shared_count(),
        "first_k_dense_replace": dense,
        "n_group": meta.get("expert_group_count", 1),
        "topk_group": meta.get("expert_group_used_count", 1),
        "routed_scaling_factor": meta.get("expert_weights_scale", 1.0),
        "norm_topk_prob": bool(meta.get("expert_weights_norm", False)),
    }


_SOFTMAX = 1  # gguf.ExpertGatingFuncType


def _deepseek2(meta: Metadata) -> dict:
    """DeepSeek-V2 (softmax scores) or V3 (sigmoid, a correction bias): latent attention, dense leading layers, shared
    experts, group-limited choice where the file has groups. `model_type` picks the family's config."""
    gating = meta.get("expert_gating_func", _SOFTMAX)  # llama.cpp reads files without the key as softmax (V2)
    if gating not in (_SOFTMAX, _SIGMOID):
        raise ValueError(f"GGUF key deepseek2.expert_gating_func {gating} is not softmax (1) or sigmoid (2)")
    v3 = gating == _SIGMOID
    layers = meta.common["num_hidden_layers"]
    experts = Experts.of(meta)
    dense = meta.get("leading_dense_block_count", 0)
    experts.check_layers(list(range(dense, layers)), f"DeepSeek (after {dense} dense ones)")
    rope_dim = meta.get("rope.dimension_count", None)
    key_mla, value_mla = meta.get("attention.key_length_mla", None), meta.get("attention.value_length_mla", None)
    if key_mla is None and meta.has_tensor("attn_kv_b.weight"):  # converters before the split kv_b and `*_mla` keys
        key_mla, value_mla = meta.get("attention.key_length", None), meta.get("attention.value_length", None)
    required = {"rope.dimension_count": rope_dim, "attention.kv_lora_rank": meta.get("attention.kv_lora_rank", None)}
    required |= {"attention.key_length_mla": key_mla, "attention.value_length_mla": value_mla}
    missing = [key for key, value in required.items() if value is None]
    if missing:
        raise ValueError(f"GGUF deepseek2 file without {', '.join('deepseek2.' + key for key in missing)}")
    groups = meta.get("expert_group_count", 1)
    rope = {k: v for k, v in meta.common["rope_parameters"].items() if k != "partial_rotary_factor"}
    if rope["rope_type"] == "yarn":
        log_multiplier = meta.get("rope.scaling.yarn_log_multiplier", None)
        if log_multiplier is None:  # no mscale: llama.cpp scales neither the tables nor the scores
            rope["attention_factor"] = 1.0
        else:
            rope["mscale"] = rope["mscale_all_dim"] = log_multiplier / 0.1
    config = {
        "model_type": "deepseek_v3" if v3 else "deepseek_v2",
        "num_key_value_heads": meta.common["num_attention_heads"],  # the latent serves every head
        "head_dim": rope_dim,
        "q_lora_rank": meta.get("attention.q_lora_rank", None),
        "kv_lora_rank": required["attention.kv_lora_rank"],
        "qk_rope_head_dim": rope_dim,
        "qk_nope_head_dim": key_mla - rope_dim,
        "v_head_dim": value_mla,
        "rope_parameters": rope,
        "n_routed_experts": experts.count,
        "num_experts_per_tok": experts.used,
        "moe_intermediate_size": experts.intermediate,
        "n_shared_experts": experts.shared_count(),
        "first_k_dense_replace": dense,
        "n_group": groups,
        "topk_group": meta.get("expert_group_used_count", 1),
        "routed_scaling_factor": meta.get("expert_weights_scale", 1.0),
        "norm_topk_prob": bool(meta.get("expert_weights_norm", False)),
        "attention_bias": False,
    }
    if v3:
        return {**config, "rope_interleave": True, "num_nextn_predict_layers": 0}
    return {**config, "topk_method": "group_limited_greedy" if groups > 1 else "greedy"}


_MIXTRAL = GGUFArchitecture("mixtral", _mixtral, _MOE_LAYER, permuted_qk=True, moe=True)  # Llama's, with experts
ARCHITECTURES: dict[str, GGUFArchitecture] = {
    "llama": GGUFArchitecture("llama", _biases, permuted_qk=True, with_experts=_MIXTRAL),
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
    "qwen2moe": GGUFArchitecture("qwen2_moe", _qwen2_moe, _MOE_LAYER, moe=True),
    "qwen3moe": GGUFArchitecture("qwen3_moe", _qwen3_moe, _MOE_LAYER, moe=True),
    "ernie4_5-moe": GGUFArchitecture("ernie4_5_moe", _ernie4_5_moe, _MOE_LAYER, moe=True),
    "glm4moe": GGUFArchitecture("glm4_moe", _glm4_moe, _GLM4_MOE_LAYER, moe=True),
    "deepseek2": GGUFArchitecture("deepseek_v2", _deepseek2, _DEEPSEEK2_LAYER, moe=True, yarn=True),
}


def gguf_architecture(name: str, expert_count: int = 0) -> GGUFArchitecture:
    """The table's entry for `general.architecture`; with experts, its `with_experts` variant where it has one."""
    if name not in ARCHITECTURES:
        raise ValueError(f"unsupported GGUF architecture {name!r}; supported: {', '.join(ARCHITECTURES)}")
    arch = ARCHITECTURES[name]
    if expert_count and not arch.moe:
        if arch.with_experts is None:
            raise ValueError(f"GGUF key {name}.expert_count (mixture-of-experts layers) is not supported for {name}")
        arch = arch.with_experts
    return arch
