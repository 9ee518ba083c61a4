"""Checkpoints whose modelling code lives in the model repository (`trust_remote_code`), read without running it.

The original Qwen (`QWenLMHeadModel`, model_type "qwen": Qwen-7B/14B/1.8B-Chat) is Qwen2's architecture under other
names, ChatGLM2/3 (`ChatGLMModel`, model_type "chatglm") is transformers' GLM's, and InternLM2 (`internlm2`) and the
7B Baichuan models (`baichuan`) are Llama's. Each layout here turns the
repository's config.json into the transformers config of that architecture and renames (and splits) its tensors
to that architecture's names; the family then loads as any other. The name mapping is in docs/model_layouts.md.

What the remote code does beyond the architecture is refused rather than ignored: the original Qwen's dynamic NTK
rotary scaling and log-n attention scaling act only past `seq_length`, so the context is held to it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import GlmConfig, LlamaConfig, PretrainedConfig, Qwen2Config

from heteroserve.model.loader.canonical_tensors import split_rows

Tensors = Iterable[tuple[str, object]]


@dataclass(frozen=True)
class RemoteCodeLayout:
    config: Callable[[dict], PretrainedConfig]  # config.json -> the transformers config of the architecture
    tensors: Callable[[Tensors, PretrainedConfig], Iterator[tuple[str, object]]]  # -> that architecture's names
    # Why the context may not exceed max_position_embeddings (None: it may, with the usual warning).
    context_limit: str | None = None


def _qwen_config(raw: dict) -> PretrainedConfig:
    heads, hidden = raw["num_attention_heads"], raw["hidden_size"]
    head_dim = raw.get("kv_channels") or hidden // heads
    if raw.get("rotary_pct", 1.0) != 1.0:
        raise ValueError(f"qwen: rotary_pct {raw['rotary_pct']} is not supported (1.0 is)")
    if raw.get("no_bias", True) is not True:
        raise ValueError("qwen: no_bias false (biases beyond c_attn's) is not supported")
    context = raw.get("seq_length") or raw["max_position_embeddings"]
    return Qwen2Config(
        vocab_size=raw["vocab_size"],
        hidden_size=hidden,
        intermediate_size=raw["intermediate_size"] // 2,  # w1 and w2 each have half of it
        num_hidden_layers=raw["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=heads,
        head_dim=head_dim,
        rms_norm_eps=raw.get("layer_norm_epsilon", 1e-6),
        # Dynamic NTK and log-n scaling change nothing up to seq_length, and are not implemented past it.
        max_position_embeddings=context,
        rope_parameters={"rope_type": "default", "rope_theta": float(raw.get("rotary_emb_base", 10000))},
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        use_sliding_window=False,
        bos_token_id=raw.get("bos_token_id"),
        eos_token_id=raw.get("eos_token_id"),
        dtype=_dtype(raw),
    )


_QWEN_GLOBALS = {"transformer.wte.": "model.embed_tokens.", "transformer.ln_f.": "model.norm.", "lm_head.": "lm_head."}
_QWEN_LAYER = {
    "ln_1.": "input_layernorm.",
    "ln_2.": "post_attention_layernorm.",
    "attn.c_proj.": "self_attn.o_proj.",
    "mlp.w2.": "mlp.gate_proj.",  # c_proj(w1(x) * silu(w2(x))): the gate is w2
    "mlp.w1.": "mlp.up_proj.",
    "mlp.c_proj.": "mlp.down_proj.",
}


def _qwen_tensors(tensors: Tensors, config: PretrainedConfig) -> Iterator[tuple[str, object]]:
    size = config.num_attention_heads * config.head_dim
    yield from _renamed(tensors, "transformer.h.", _QWEN_GLOBALS, _QWEN_LAYER, "attn.c_attn.", [size] * 3)


def _chatglm_config(raw: dict) -> PretrainedConfig:
    heads, hidden = raw["num_attention_heads"], raw["hidden_size"]
    for key, wanted in (
        ("rmsnorm", True),
        ("apply_residual_connection_post_layernorm", False),
        ("post_layer_norm", True),
    ):
        if raw.get(key, wanted) != wanted:
            raise ValueError(f"chatglm: {key}={raw[key]} is not supported ({wanted} is)")
    if raw.get("add_bias_linear"):
        raise ValueError("chatglm: add_bias_linear (biases on the output and MLP projections) is not supported")
    if raw.get("pre_seq_len"):
        raise ValueError("chatglm: a prefix encoder (pre_seq_len, P-tuning v2) is not supported")
    kv_heads = raw["multi_query_group_num"] if raw.get("multi_query_attention") else heads
    return GlmConfig(
        vocab_size=raw.get("padded_vocab_size") or raw["vocab_size"],
        hidden_size=hidden,
        intermediate_size=raw["ffn_hidden_size"],
        num_hidden_layers=raw["num_layers"],
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=raw.get("kv_channels") or hidden // heads,
        rms_norm_eps=raw.get("layernorm_epsilon", 1e-5),
        max_position_embeddings=raw.get("seq_length", 8192),
        attention_bias=bool(raw.get("add_qkv_bias", True)),
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0 * float(raw.get("rope_ratio", 1.0)),
            "partial_rotary_factor": 0.5,  # ChatGLM rotates half of each head, in adjacent pairs
        },
        tie_word_embeddings=False,
        pad_token_id=raw.get("pad_token_id"),
        eos_token_id=raw.get("eos_token_id"),
        dtype=_dtype(raw),
    )


_CHATGLM_GLOBALS = {
    "transformer.embedding.word_embeddings.": "model.embed_tokens.",
    "transformer.encoder.final_layernorm.": "model.norm.",
    "transformer.output_layer.": "lm_head.",
    "transformer.rotary_pos_emb.": None,  # the inverse frequencies, recomputed from the config
}
_CHATGLM_LAYER = {
    "input_layernorm.": "input_layernorm.",
    "post_attention_layernorm.": "post_attention_layernorm.",
    "self_attention.dense.": "self_attn.o_proj.",
    "mlp.dense_h_to_4h.": "mlp.gate_up_proj.",  # [gate | up], split by the GLM family
    "mlp.dense_4h_to_h.": "mlp.down_proj.",
}


def _chatglm_tensors(tensors: Tensors, config: PretrainedConfig) -> Iterator[tuple[str, object]]:
    d = config.head_dim
    sizes = [config.num_attention_heads * d, config.num_key_value_heads * d, config.num_key_value_heads * d]
    yield from _renamed(
        tensors,
        "transformer.encoder.layers.",
        _CHATGLM_GLOBALS,
        _CHATGLM_LAYER,
        "self_attention.query_key_value.",
        sizes,
    )


def _renamed(
    tensors: Tensors,
    layer_prefix: str,
    globals_: dict[str, str | None],
    layer: dict[str, str],
    fused_qkv: str,
    qkv_sizes: list[int],
    qkv_row_order: torch.Tensor | None = None,
) -> Iterator[tuple[str, object]]:
    """Tensors under the architecture's names: `globals_` and `layer` map name prefixes (None: dropped), the
    fused q/k/v projection is split into `qkv_sizes` rows after taking them in `qkv_row_order` (where the
    checkpoint interleaves them)."""
    pattern = re.compile(rf"^{re.escape(layer_prefix)}(\d+)\.(.+)$")
    for name, tensor in tensors:
        match = pattern.match(name)
        if match is None:
            prefix = next((p for p in globals_ if name.startswith(p)), None)
            if prefix is None:
                raise ValueError(f"unexpected tensor {name!r} in this checkpoint layout")
            if globals_[prefix] is not None:
                yield globals_[prefix] + name[len(prefix) :], tensor
            continue
        index, rest = match.groups()
        out = f"model.layers.{index}."
        if rest.startswith(fused_qkv):
            suffix = rest[len(fused_qkv) :]
            if qkv_row_order is not None:
                tensor = (
                    tensor[qkv_row_order] if isinstance(tensor, torch.Tensor) else tensor.permute_rows(qkv_row_order)
                )
            for part, value in zip("qkv", split_rows(tensor, qkv_sizes), strict=True):
                yield f"{out}self_attn.{part}_proj.{suffix}", value
            continue
        prefix = next((p for p in layer if rest.startswith(p)), None)
        if prefix is None:
            raise ValueError(f"unexpected tensor {name!r} in this checkpoint layout")
        yield out + layer[prefix] + rest[len(prefix) :], tensor


def _internlm2_config(raw: dict) -> PretrainedConfig:
    scaling = raw.get("rope_scaling") or {}
    if scaling and scaling.get("type", scaling.get("rope_type")) not in ("dynamic", "linear"):
        raise ValueError(f"internlm2: rope_scaling {scaling} is not supported")
    rope = {"rope_type": "default", "rope_theta": float(raw.get("rope_theta", 10000))}
    if scaling.get("type", scaling.get("rope_type")) == "linear":
        rope = {**rope, "rope_type": "linear", "factor": float(scaling["factor"])}
    if raw.get("bias"):
        raise ValueError("internlm2: bias true (biases on every projection) is not supported")
    return LlamaConfig(
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        intermediate_size=raw["intermediate_size"],
        num_hidden_layers=raw["num_hidden_layers"],
        num_attention_heads=raw["num_attention_heads"],
        num_key_value_heads=raw.get("num_key_value_heads") or raw["num_attention_heads"],
        rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
        # Dynamic NTK changes nothing up to max_position_embeddings, and is not implemented past it.
        max_position_embeddings=raw["max_position_embeddings"],
        rope_parameters=rope,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_id=raw.get("eos_token_id"),
        dtype=_dtype(raw),
    )


_INTERNLM2_GLOBALS = {
    "model.tok_embeddings.": "model.embed_tokens.",
    "model.norm.": "model.norm.",
    "output.": "lm_head.",
}
_INTERNLM2_LAYER = {
    "attention_norm.": "input_layernorm.",
    "ffn_norm.": "post_attention_layernorm.",
    "attention.wo.": "self_attn.o_proj.",
    "feed_forward.w1.": "mlp.gate_proj.",
    "feed_forward.w3.": "mlp.up_proj.",
    "feed_forward.w2.": "mlp.down_proj.",
}


def _internlm2_tensors(tensors: Tensors, config: PretrainedConfig) -> Iterator[tuple[str, object]]:
    """wqkv holds, per KV head, its query heads' rows, then its key's, then its value's: taken in q, k, v order."""
    d, kv_heads = config.head_dim, config.num_key_value_heads
    group = config.num_attention_heads // kv_heads  # query heads per KV head
    rows = torch.arange(kv_heads * (group + 2) * d).view(kv_heads, group + 2, d)
    order = torch.cat([rows[:, :group].flatten(), rows[:, group].flatten(), rows[:, group + 1].flatten()])
    sizes = [config.num_attention_heads * d, kv_heads * d, kv_heads * d]
    yield from _renamed(tensors, "model.layers.", _INTERNLM2_GLOBALS, _INTERNLM2_LAYER, "attention.wqkv.", sizes, order)


# Baichuan2's vocabulary size: its output layer normalises each row of its weight at inference (NormHead), which
# Baichuan 1 does not; the config does not say which is which otherwise.
BAICHUAN2_VOCAB = 125696


def _baichuan_config(raw: dict) -> PretrainedConfig:
    architectures = raw.get("architectures") or []
    rotary = "BaiChuanForCausalLM" in architectures or raw.get("hidden_size") == 4096  # the 7B models
    if not rotary:
        raise ValueError(
            "baichuan: the 13B models (BaichuanForCausalLM with hidden_size other than 4096) use ALiBi position "
            "biases, which are not implemented; the 7B models (rotary) are"
        )
    heads = raw["num_attention_heads"]
    return LlamaConfig(
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        intermediate_size=raw["intermediate_size"],
        num_hidden_layers=raw["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=heads,
        rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
        max_position_embeddings=raw.get("max_position_embeddings") or raw.get("model_max_length", 4096),
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_id=raw.get("eos_token_id"),
        dtype=_dtype(raw),
    )


_BAICHUAN_GLOBALS = {"model.embed_tokens.": "model.embed_tokens.", "model.norm.": "model.norm.", "lm_head.": "lm_head."}
_BAICHUAN_LAYER = {
    name: name
    for name in ("input_layernorm.", "post_attention_layernorm.", "self_attn.o_proj.", "mlp.gate_proj.", "mlp.up_proj.")
} | {"mlp.down_proj.": "mlp.down_proj."}


def _baichuan_tensors(tensors: Tensors, config: PretrainedConfig) -> Iterator[tuple[str, object]]:
    size = config.num_attention_heads * config.head_dim
    for name, tensor in _renamed(
        tensors, "model.layers.", _BAICHUAN_GLOBALS, _BAICHUAN_LAYER, "self_attn.W_pack.", [size] * 3
    ):
        if name == "lm_head.weight" and config.vocab_size == BAICHUAN2_VOCAB:
            if not isinstance(tensor, torch.Tensor):
                raise ValueError("baichuan2: a compressed output layer cannot be normalised (NormHead)")
            tensor = torch.nn.functional.normalize(tensor.float(), dim=-1).to(tensor.dtype)
        yield name, tensor


def _dtype(raw: dict) -> str:
    if raw.get("bf16"):
        return "bfloat16"
    if raw.get("fp16"):
        return "float16"
    return raw.get("torch_dtype") or raw.get("dtype") or "float32"


LAYOUTS: dict[str, RemoteCodeLayout] = {
    "qwen": RemoteCodeLayout(
        _qwen_config,
        _qwen_tensors,
        "the original Qwen's dynamic NTK rotary scaling and log-n attention scaling, which act past its seq_length, "
        "are not implemented",
    ),
    "chatglm": RemoteCodeLayout(_chatglm_config, _chatglm_tensors),
    "internlm2": RemoteCodeLayout(
        _internlm2_config,
        _internlm2_tensors,
        "InternLM2's dynamic NTK rotary scaling (where its config sets it), which acts past "
        "max_position_embeddings, is not implemented",
    ),
    "baichuan": RemoteCodeLayout(_baichuan_config, _baichuan_tensors),
}


def remote_code_layout(folder: Path) -> RemoteCodeLayout | None:
    """The layout of the folder's config.json model_type, where it is one of LAYOUTS."""
    path = folder / "config.json"
    if not path.is_file():
        return None
    try:
        model_type = json.loads(path.read_text()).get("model_type")
    except (json.JSONDecodeError, AttributeError):
        return None
    return LAYOUTS.get(model_type)


def read_remote_code_config(folder: Path, layout: RemoteCodeLayout) -> PretrainedConfig:
    raw = json.loads((folder / "config.json").read_text())
    try:
        config = layout.config(raw)
    except KeyError as exc:
        raise ValueError(f"{folder}/config.json lacks {exc} for a {raw.get('model_type')} checkpoint") from exc
    if "quantization_config" in raw:
        config.quantization_config = raw["quantization_config"]
    return config
