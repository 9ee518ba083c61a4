"""Writes a transformers Qwen2 / GLM checkpoint in the original Qwen / ChatGLM2-3 repository layout.

These layouts' modelling code lives in the model repositories (trust_remote_code), so there is no transformers
class to build a reference from; their architectures are transformers' Qwen2 (the original Qwen) and GLM
(ChatGLM), whose classes are the reference. This script is the inverse of heteroserve's mapping
(heteroserve/model/loader/remote_code_layouts.py), written from the repositories' own names (docs/model_layouts.md):
fused query/key/value rows, the original Qwen's gate on `w2`, ChatGLM's `dense_h_to_4h`, and each repository's
config.json keys. A mistake on either side makes the loaded model differ from the reference.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import PreTrainedModel


def _layer_tensors(state: dict[str, torch.Tensor], i: int) -> dict[str, torch.Tensor]:
    prefix = f"model.layers.{i}."
    return {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}


def _save(tensors: dict[str, torch.Tensor], raw_config: dict, folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, folder / "model.safetensors", metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(raw_config, indent=2))


def write_original_qwen(model: PreTrainedModel, folder: Path) -> None:
    """A Qwen2 model (q/k/v biases, no o bias, full rotary, as many KV heads as query heads) as QWenLMHeadModel."""
    config = model.config
    assert config.num_key_value_heads == config.num_attention_heads, "the original Qwen has no grouped KV heads"
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    out = {
        "transformer.wte.weight": state["model.embed_tokens.weight"],
        "transformer.ln_f.weight": state["model.norm.weight"],
    }
    if not config.tie_word_embeddings:
        out["lm_head.weight"] = state["lm_head.weight"]
    for i in range(config.num_hidden_layers):
        t, p = _layer_tensors(state, i), f"transformer.h.{i}."
        out[p + "ln_1.weight"] = t["input_layernorm.weight"]
        out[p + "ln_2.weight"] = t["post_attention_layernorm.weight"]
        for kind in ("weight", "bias"):
            out[p + f"attn.c_attn.{kind}"] = torch.cat([t[f"self_attn.{n}_proj.{kind}"] for n in "qkv"])
        out[p + "attn.c_proj.weight"] = t["self_attn.o_proj.weight"]
        out[p + "mlp.w1.weight"] = t["mlp.up_proj.weight"]  # the original multiplies w1(x) by silu(w2(x))
        out[p + "mlp.w2.weight"] = t["mlp.gate_proj.weight"]
        out[p + "mlp.c_proj.weight"] = t["mlp.down_proj.weight"]
    raw = {
        "architectures": ["QWenLMHeadModel"],
        "auto_map": {"AutoConfig": "configuration_qwen.QWenConfig"},
        "model_type": "qwen",
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": 2 * config.intermediate_size,  # the repository's, twice each of w1 / w2
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "kv_channels": config.head_dim,
        "layer_norm_epsilon": config.rms_norm_eps,
        "max_position_embeddings": config.max_position_embeddings,
        "seq_length": config.max_position_embeddings,
        "rotary_emb_base": config.rope_parameters["rope_theta"],
        "rotary_pct": 1.0,
        "use_dynamic_ntk": True,
        "use_logn_attn": True,
        "no_bias": True,
        "tie_word_embeddings": config.tie_word_embeddings,
        "fp32": True,
    }
    _save(out, raw, folder)


def write_chatglm(model: PreTrainedModel, folder: Path) -> None:
    """A GLM model (half-head interleaved rotary, q/k/v biases, fused gate/up) as ChatGLMModel (ChatGLM2/3)."""
    config = model.config
    assert not config.tie_word_embeddings, "ChatGLM keeps its output layer apart from the embedding"
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    out = {
        "transformer.embedding.word_embeddings.weight": state["model.embed_tokens.weight"],
        "transformer.encoder.final_layernorm.weight": state["model.norm.weight"],
        "transformer.output_layer.weight": state["lm_head.weight"],
    }
    rotary = config.head_dim // 2
    base = config.rope_parameters["rope_theta"]
    out["transformer.rotary_pos_emb.inv_freq"] = 1.0 / (base ** (torch.arange(0, rotary, 2).float() / rotary))
    for i in range(config.num_hidden_layers):
        t, p = _layer_tensors(state, i), f"transformer.encoder.layers.{i}."
        out[p + "input_layernorm.weight"] = t["input_layernorm.weight"]
        out[p + "post_attention_layernorm.weight"] = t["post_attention_layernorm.weight"]
        for kind in ("weight", "bias"):
            qkv = torch.cat([t[f"self_attn.{n}_proj.{kind}"] for n in "qkv"])
            out[p + f"self_attention.query_key_value.{kind}"] = qkv
        out[p + "self_attention.dense.weight"] = t["self_attn.o_proj.weight"]
        out[p + "mlp.dense_h_to_4h.weight"] = t["mlp.gate_up_proj.weight"]
        out[p + "mlp.dense_4h_to_h.weight"] = t["mlp.down_proj.weight"]
    raw = {
        "architectures": ["ChatGLMModel"],
        "auto_map": {"AutoConfig": "configuration_chatglm.ChatGLMConfig"},
        "model_type": "chatglm",
        "add_bias_linear": False,
        "add_qkv_bias": True,
        "apply_query_key_layer_scaling": True,
        "apply_residual_connection_post_layernorm": False,
        "attention_softmax_in_fp32": True,
        "ffn_hidden_size": config.intermediate_size,
        "hidden_size": config.hidden_size,
        "kv_channels": config.head_dim,
        "layernorm_epsilon": config.rms_norm_eps,
        "multi_query_attention": True,
        "multi_query_group_num": config.num_key_value_heads,
        "num_attention_heads": config.num_attention_heads,
        "num_layers": config.num_hidden_layers,
        "original_rope": True,
        "padded_vocab_size": config.vocab_size,
        "post_layer_norm": True,
        "rmsnorm": True,
        "rope_ratio": base / 10000.0,
        "seq_length": config.max_position_embeddings,
        "torch_dtype": "float32",
        "tie_word_embeddings": False,
    }
    _save(out, raw, folder)


def _llama_layer_tensors(t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The names a Llama layer's tensors keep in layouts that only rename a few of them."""
    return {
        "input_layernorm.weight": t["input_layernorm.weight"],
        "post_attention_layernorm.weight": t["post_attention_layernorm.weight"],
        "self_attn.o_proj.weight": t["self_attn.o_proj.weight"],
        "mlp.gate_proj.weight": t["mlp.gate_proj.weight"],
        "mlp.up_proj.weight": t["mlp.up_proj.weight"],
        "mlp.down_proj.weight": t["mlp.down_proj.weight"],
    }


def write_internlm2(model: PreTrainedModel, folder: Path) -> None:
    """A Llama model as InternLM2ForCausalLM: wqkv holds, per KV head, its query heads, its key, its value."""
    config = model.config
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    d, kv_heads = config.head_dim, config.num_key_value_heads
    group = config.num_attention_heads // kv_heads
    out = {
        "model.tok_embeddings.weight": state["model.embed_tokens.weight"],
        "model.norm.weight": state["model.norm.weight"],
    }
    out["output.weight"] = state["lm_head.weight"]
    for i in range(config.num_hidden_layers):
        t, p = _layer_tensors(state, i), f"model.layers.{i}."
        q = t["self_attn.q_proj.weight"].view(kv_heads, group * d, -1)
        k = t["self_attn.k_proj.weight"].view(kv_heads, d, -1)
        v = t["self_attn.v_proj.weight"].view(kv_heads, d, -1)
        out[p + "attention.wqkv.weight"] = torch.cat([q, k, v], dim=1).reshape(-1, config.hidden_size)
        out[p + "attention.wo.weight"] = t["self_attn.o_proj.weight"]
        out[p + "attention_norm.weight"] = t["input_layernorm.weight"]
        out[p + "ffn_norm.weight"] = t["post_attention_layernorm.weight"]
        out[p + "feed_forward.w1.weight"] = t["mlp.gate_proj.weight"]
        out[p + "feed_forward.w3.weight"] = t["mlp.up_proj.weight"]
        out[p + "feed_forward.w2.weight"] = t["mlp.down_proj.weight"]
    raw = {
        "architectures": ["InternLM2ForCausalLM"],
        "auto_map": {"AutoConfig": "configuration_internlm2.InternLM2Config"},
        "model_type": "internlm2",
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": kv_heads,
        "rms_norm_eps": config.rms_norm_eps,
        "max_position_embeddings": config.max_position_embeddings,
        "rope_theta": config.rope_parameters["rope_theta"],
        "rope_scaling": {"type": "dynamic", "factor": 2.0},
        "bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }
    _save(out, raw, folder)


def write_baichuan(
    model: PreTrainedModel, folder: Path, architecture: str, row_scales: torch.Tensor | None = None
) -> None:
    """A Llama model (as many KV heads as query heads) as a Baichuan: q/k/v in one W_pack. architecture:
    BaiChuanForCausalLM is Baichuan-7B's (rotary); BaichuanForCausalLM is Baichuan2's, rotary at hidden size 4096
    (7B) and ALiBi otherwise (13B). row_scales: the output layer's rows are stored multiplied by them, as
    Baichuan2's un-normalised NormHead weight (the model normalises each row, as the reference's head holds)."""
    config = model.config
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    head = state["lm_head.weight"] if row_scales is None else state["lm_head.weight"] * row_scales[:, None]
    out = {
        "model.embed_tokens.weight": state["model.embed_tokens.weight"],
        "model.norm.weight": state["model.norm.weight"],
    }
    out["lm_head.weight"] = head
    for i in range(config.num_hidden_layers):
        t, p = _layer_tensors(state, i), f"model.layers.{i}."
        out |= {p + name: value for name, value in _llama_layer_tensors(t).items()}
        out[p + "self_attn.W_pack.weight"] = torch.cat([t[f"self_attn.{n}_proj.weight"] for n in "qkv"])
    raw = {
        "architectures": [architecture],
        "auto_map": {"AutoConfig": "configuration_baichuan.BaichuanConfig"},
        "model_type": "baichuan",
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "rms_norm_eps": config.rms_norm_eps,
        "max_position_embeddings": config.max_position_embeddings,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }
    _save(out, raw, folder)
