"""GGUF mixtures of experts as llama.cpp writes them, experts kept compressed, against transformers.

Each tiny MoE model of tests/model/tiny_models.py is written the way convert_hf_to_gguf.py writes its
architecture (`ARCHITECTURES`): tensor names from the gguf package's own name map, each layer's experts stacked
into 3-D `ffn_{gate,up,down}_exps` tensors, the router (`ffn_gate_inp`) kept float32, the converter's MoE keys.
Files are float32, or quantised (Q8_0 / Q4_0) and loaded with every expert a compressed weight of its own rows.
A quantised file is compared with transformers' own GGUF loader on the same file where it reads the architecture
(qwen2moe, qwen3moe), and otherwise with the transformers model whose matrices went through the same quantisation
(exact either way). Every block type kept compressed (K-quants included) is sliced per expert out of a 3-D
stack of random blocks and checked against the gguf package.

What GGUF cannot say takes llama.cpp's layout: its qwen2moe and qwen3moe have experts on every layer, so those
tiny models go without their dense layer here, and its deepseek2 keeps one YaRN mscale, so DeepSeek-V3's tiny model
takes mscale = mscale_all_dim. DeepSeek's files split latent attention's kv_b_proj per head (attn_k_b, attn_v_b).

Opt-in, as in test_gguf_families.py: HETEROSERVE_LLAMA_CPP (a llama.cpp source tree) runs the same models through
llama.cpp's own convert_hf_to_gguf.py, whose files must hold what `write_moe_gguf` writes;
HETEROSERVE_LLAMA_CPP_PYTHON (llama-cpp-python's source) with LLAMA_CPP_LIB_PATH (a built libllama's folder)
compares with llama.cpp's logits on the same files, and has llama.cpp quantise wider models to Q4_K_M (Q4_K and
Q6_K experts), which are checked against transformers on the file's values and against llama.cpp (which cases
each takes: LIBLLAMA_CASES, K_QUANT_CASES).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import MODEL_ARCH_NAMES, GGMLQuantizationType, GGUFReader, GGUFWriter, get_tensor_name_map
from gguf.quants import QuantError, dequantize, quantize

from heteroserve import LLM
from heteroserve.model.loader import gguf_loader
from heteroserve.model.mla import LatentAttention
from heteroserve.quantization.ggml import BLOCK_BYTES
from tests.model.test_gguf import permute, write_tensors
from tests.model.test_gguf_families import (
    _CONVERT,
    LLAMA_CPP,
    LLAMA_CPP_PYTHON,
    _add_byte_vocab,
    llama_cpp_logits,
)
from tests.model.tiny_models import (
    MAX_MODEL_LEN,
    SPECS,
    as_reference,
    build_hf_model,
    check_output,
    greedy_params,
    load_reference,
    prompts,
    randomize,
    run,
)

F32, Q8_0, Q4_0 = GGMLQuantizationType.F32, GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_0
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+?)(?:\.(weight|bias))?$")


@dataclass(frozen=True)
class Architecture:
    """How convert_hf_to_gguf.py writes one MoE architecture: its name, the keys its model class adds."""

    name: str
    permute_qk: bool = False  # Llama's converter (Mixtral)
    keys: dict[str, object] = field(default_factory=dict)  # `<arch>.<key>` -> a config attribute, or a function
    latent: bool = False  # DeepSeek's: one latent KV head, kv_b_proj split per head into attn_k_b and attn_v_b


def _rope_half(cfg) -> int:
    return int(cfg.head_dim * cfg.rope_parameters.get("partial_rotary_factor", 1.0))


ARCHITECTURES = {
    "mixtral": Architecture(
        "llama", permute_qk=True, keys={"vocab_size": "vocab_size", "rope.dimension_count": "head_dim"}
    ),
    "qwen2_moe": Architecture(
        "qwen2moe",
        keys={
            "expert_feed_forward_length": "moe_intermediate_size",
            "expert_shared_feed_forward_length": "shared_expert_intermediate_size",
        },
    ),
    "qwen3_moe": Architecture("qwen3moe", keys={"expert_feed_forward_length": "moe_intermediate_size"}),
    "ernie4_5_moe": Architecture(
        "ernie4_5-moe",
        keys={
            "interleave_moe_layer_step": "moe_layer_interval",
            "leading_dense_block_count": "moe_layer_start_index",
            "expert_feed_forward_length": "moe_intermediate_size",
            "expert_shared_count": "moe_num_shared_experts",
            # the converter's own guess at the shared experts' size, not theirs: the loader reads the tensors
            "expert_shared_feed_forward_length": lambda cfg: cfg.intermediate_size // cfg.num_key_value_heads,
        },
    ),
    "glm4_moe": Architecture(
        "glm4moe",
        keys={
            "rope.dimension_count": _rope_half,
            "expert_feed_forward_length": "moe_intermediate_size",
            "expert_shared_count": "n_shared_experts",
            "leading_dense_block_count": "first_k_dense_replace",
            "expert_gating_func": lambda cfg: 2,  # sigmoid
            "expert_weights_scale": "routed_scaling_factor",
            "expert_weights_norm": "norm_topk_prob",
            "expert_group_count": "n_group",
            "expert_group_used_count": "topk_group",
            "nextn_predict_layers": "num_nextn_predict_layers",
        },
    ),
}


def _yarn_keys(cfg) -> dict[str, object]:
    rope = cfg.rope_parameters
    return {
        "rope.scaling.type": "yarn",
        "rope.scaling.factor": float(rope["factor"]),
        "rope.scaling.original_context_length": rope["original_max_position_embeddings"],
        "rope.scaling.yarn_beta_fast": float(rope["beta_fast"]),
        "rope.scaling.yarn_beta_slow": float(rope["beta_slow"]),
        "rope.scaling.yarn_log_multiplier": 0.1 * rope["mscale_all_dim"],
    }


def _deepseek2(weights_norm: bool) -> Architecture:
    """DeepSeek's converter: the latent's sizes, the heads' under the `*_mla` keys, MoE keys (the scoring from the
    checkpoint's `scoring_func`, which transformers' configs do not define and DeepSeek's config.json files carry)
    and YaRN's."""
    keys: dict[str, object] = {
        "vocab_size": "vocab_size",
        "leading_dense_block_count": "first_k_dense_replace",
        "attention.kv_lora_rank": "kv_lora_rank",
        "attention.key_length_mla": lambda cfg: cfg.qk_nope_head_dim + cfg.qk_rope_head_dim,
        "attention.value_length_mla": "v_head_dim",
        "expert_feed_forward_length": "moe_intermediate_size",
        "expert_shared_count": "n_shared_experts",
        "expert_weights_scale": lambda cfg: float(cfg.routed_scaling_factor),
        "rope.dimension_count": "qk_rope_head_dim",
        "expert_group_count": "n_group",
        "expert_group_used_count": "topk_group",
        "expert_gating_func": lambda cfg: {"softmax": 1, "sigmoid": 2}[cfg.scoring_func],
        "yarn": _yarn_keys,
    }
    if weights_norm:
        keys["expert_weights_norm"] = "norm_topk_prob"
    return Architecture("deepseek2", keys=keys, latent=True)


ARCHITECTURES |= {
    "deepseek_v2": _deepseek2(weights_norm=False),
    "deepseek_v3": _deepseek2(weights_norm=True),
}
# GGUF holds one YaRN mscale (llama.cpp's): DeepSeek-V3's tiny model takes mscale = mscale_all_dim here.
_V3_ROPE = {**SPECS["deepseek_v3"][1]["rope_parameters"], "mscale": 0.8}

# Blocks of 32 need 32 | every matrix's columns: Mixtral's expert size and Qwen2-MoE's shared one go to 64.
# llama.cpp's qwen2moe/qwen3moe have no dense layers; its ERNIE reads the shared size as intermediate / kv heads.
# DeepSeek-V3's query bottleneck goes to 64 (its q_b_proj's columns).
# case -> (SPECS entry, quantised type, config overrides, seed)
CASES = {
    "mixtral": ("mixtral", Q4_0, {"intermediate_size": 64}, 71),
    "qwen2_moe": ("qwen2_moe", Q8_0, {"shared_expert_intermediate_size": 64, "mlp_only_layers": []}, 72),
    "qwen3_moe": ("qwen3_moe", Q4_0, {"mlp_only_layers": []}, 73),
    "ernie4_5_moe": ("ernie4_5_moe", Q8_0, {"moe_num_shared_experts": 2}, 74),
    "glm4_moe": ("glm4_moe", Q4_0, {}, 75),
    "deepseek_v2": ("deepseek_v2", Q8_0, {"scoring_func": "softmax"}, 76),
    "deepseek_v3": (
        "deepseek_v3",
        Q4_0,
        {"scoring_func": "sigmoid", "rope_parameters": _V3_ROPE, "q_lora_rank": 64},
        77,
    ),
}
# Files libllama loads: it reads a deepseek2 file without a query bottleneck (attention.q_lora_rank) only at
# DeepSeek-V2-Lite's 26 or 27 layers, so the tiny V2 is not among them.
LIBLLAMA_CASES = [case for case in CASES if case != "deepseek_v2"]
# Grown to K-quant block sizes (K_QUANT_OVERRIDES); DeepSeek's latent sizes are not.
K_QUANT_CASES = [case for case in CASES if not case.startswith("deepseek")]
# transformers' GGUF loader reads these architectures (it stacks the experts back itself).
TRANSFORMERS_READS = {"qwen2_moe", "qwen3_moe"}


def _names(arch: Architecture, cfg, module: str, suffix: str | None) -> list[tuple[str, slice | None]]:
    """The GGUF tensors (`kind.suffix`, with the rows of each) that one transformers tensor becomes."""
    if module == "mlp.experts.gate_up_proj":  # transformers keeps each layer's experts stacked, gate rows first
        rows = cfg.moe_intermediate_size if hasattr(cfg, "moe_intermediate_size") else cfg.intermediate_size
        return [("ffn_gate_exps.weight", slice(0, rows)), ("ffn_up_exps.weight", slice(rows, 2 * rows))]
    if module == "mlp.experts.down_proj":
        return [("ffn_down_exps.weight", None)]
    if module.endswith("e_score_correction_bias"):  # GLM's router buffer, ERNIE's moe_statics
        return [("exp_probs_b.bias", None)]
    arch_id = next(key for key, value in MODEL_ARCH_NAMES.items() if value == arch.name)
    name = get_tensor_name_map(arch_id, cfg.num_hidden_layers).get_name(f"model.layers.0.{module}")
    assert name is not None, f"llama.cpp's {arch.name} has no tensor for {module}"
    return [(f"{name.removeprefix('blk.0.')}.{suffix}", None)]


def write_moe_gguf(
    model,
    arch: Architecture,
    path: Path,
    qtype: GGMLQuantizationType = F32,
    vocab=False,
    flat_shared_gate=False,
    whole_kv_b=False,
) -> Path:
    """The transformers MoE model as convert_hf_to_gguf.py writes `arch`; with `vocab`, a byte vocabulary llama.cpp
    can load. GLM-4.5's multi-token-prediction block is written after the model's (the converter counts it in
    block_count; transformers builds none, so it holds the last layer's weights and placeholder nextn tensors).
    With `flat_shared_gate`, Qwen2-MoE's shared-expert gate [1, hidden] is written as a vector, as older
    converters squeezed it (transformers' GGUF loader reads it only so); with `whole_kv_b`, DeepSeek's kv_b_proj
    as one attn_kv_b and the heads' sizes as key and value lengths, as converters before the split wrote them."""
    cfg = model.config
    heads, kv_heads = cfg.num_attention_heads, 1 if arch.latent else cfg.num_key_value_heads
    sd = {name: t.detach().float().numpy() for name, t in model.state_dict().items()}
    tensors = {"token_embd.weight": sd["model.embed_tokens.weight"], "output_norm.weight": sd["model.norm.weight"]}
    if not cfg.tie_word_embeddings:
        tensors["output.weight"] = sd["lm_head.weight"]
    for name, value in sd.items():
        match = _LAYER.match(name)
        if match is None:
            continue
        index, module, suffix = match.groups()
        if module == "self_attn.kv_b_proj" and not whole_kv_b:  # per head: its key rows transposed, its value rows
            kv_b = value.reshape(heads, cfg.qk_nope_head_dim + cfg.v_head_dim, -1)
            tensors[f"blk.{index}.attn_k_b.weight"] = np.ascontiguousarray(
                kv_b[:, : cfg.qk_nope_head_dim].transpose(0, 2, 1)
            )
            tensors[f"blk.{index}.attn_v_b.weight"] = np.ascontiguousarray(kv_b[:, cfg.qk_nope_head_dim :])
            continue
        for ours, rows in _names(arch, cfg, module, suffix):
            part = value if rows is None else value[:, rows]
            if arch.permute_qk and ours.startswith(("attn_q.", "attn_k.")):
                part = permute(part, heads, heads if ours.startswith("attn_q.") else kv_heads)
            if flat_shared_gate and ours == "ffn_gate_inp_shexp.weight":
                part = part[0]
            tensors[f"blk.{index}.{ours}"] = np.ascontiguousarray(part)
    nextn = getattr(cfg, "num_nextn_predict_layers", 0) or 0
    last, h = f"blk.{cfg.num_hidden_layers - 1}.", cfg.hidden_size
    for i in range(cfg.num_hidden_layers, cfg.num_hidden_layers + nextn):  # a layer like the last, and its nextn.*
        tensors |= {f"blk.{i}.{n.removeprefix(last)}": v for n, v in list(tensors.items()) if n.startswith(last)}
        tensors |= {f"blk.{i}.nextn.eh_proj.weight": np.zeros((h, 2 * h), np.float32)}
        tensors |= {f"blk.{i}.nextn.{n}.weight": np.ones(h, np.float32) for n in ("enorm", "hnorm")}

    writer = GGUFWriter(path, arch.name)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers + nextn)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    if arch.latent and whole_kv_b:  # the heads' sizes
        writer.add_key_length(cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
        writer.add_value_length(cfg.v_head_dim)
        if cfg.q_lora_rank is not None:
            writer.add_q_lora_rank(cfg.q_lora_rank)
    elif arch.latent:  # one KV head: the latent and the rotary key; the values are the latent
        writer.add_key_length(cfg.kv_lora_rank + cfg.qk_rope_head_dim)
        writer.add_value_length(cfg.kv_lora_rank)
        if cfg.q_lora_rank is not None:
            writer.add_q_lora_rank(cfg.q_lora_rank)
    else:
        writer.add_key_length(cfg.head_dim)
        writer.add_value_length(cfg.head_dim)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    experts = next(
        getattr(cfg, k)
        for k in ("num_local_experts", "num_experts", "moe_num_experts", "n_routed_experts")
        if hasattr(cfg, k)
    )
    writer.add_expert_count(experts)
    writer.add_expert_used_count(getattr(cfg, "num_experts_per_tok", None) or cfg.moe_k)
    adders = {bool: writer.add_bool, float: writer.add_float32, int: writer.add_uint32, str: writer.add_string}
    for key, source in arch.keys.items():
        if whole_kv_b and key.endswith("_mla"):
            continue
        value = source(cfg) if callable(source) else getattr(cfg, source)
        for name, item in value.items() if isinstance(value, dict) else [(key, value)]:
            adders[type(item)](f"{arch.name}.{name}", item)
    if vocab:
        _add_byte_vocab(writer, cfg.vocab_size)
    write_tensors(writer, tensors, qtype)
    return path


@torch.no_grad()
def round_trip(model, qtype: GGMLQuantizationType) -> None:
    """The matrices the converter quantises (expert stacks included, routers not) replaced by their `qtype` values:
    the blocks run along rows, so the converter's q/k permutation and gate/up split commute with it."""
    for name, param in model.named_parameters():
        if name.endswith("kv_b_proj.weight"):  # DeepSeek's: its per-head halves (write_moe_gguf), each as written
            _round_trip_kv_b(param, model.config, qtype)
        elif param.ndim >= 2 and not name.endswith(("mlp.gate.weight", "shared_expert_gate.weight", "correction_bias")):
            values = param.detach().numpy()
            param.copy_(torch.from_numpy(dequantize(quantize(values, qtype), qtype).reshape(values.shape)))


def _round_trip_kv_b(param: torch.Tensor, cfg, qtype: GGMLQuantizationType) -> None:
    """attn_k_b holds each head's key rows transposed (rows of qk_nope_head_dim values), attn_v_b its value rows:
    each half through `qtype`, or float16 where its rows are not whole blocks (the converter's fallback, as
    write_tensors takes it)."""
    heads, nope = cfg.num_attention_heads, cfg.qk_nope_head_dim
    kv_b = param.detach().view(heads, nope + cfg.v_head_dim, -1)
    for part in (kv_b[:, :nope].transpose(1, 2), kv_b[:, nope:]):
        values = part.numpy().copy()
        try:
            rounded = dequantize(quantize(values, qtype), qtype).reshape(values.shape)
        except QuantError:
            rounded = values.astype(np.float16).astype(np.float32)
        part.copy_(torch.from_numpy(np.array(rounded, dtype=np.float32)))


@torch.no_grad()
def load_gguf_weights(model, arch: Architecture, path: Path) -> None:
    """The transformers model's weights replaced by the file's, dequantised by the gguf package and put back in
    the transformers layout by `write_moe_gguf`'s own mapping: the reference for a file llama.cpp quantised."""
    cfg = model.config
    tensors = {t.name: t for t in GGUFReader(path).tensors}

    def read(name: str) -> np.ndarray:
        tensor = tensors[name]
        shape = tuple(int(d) for d in reversed(tensor.shape))
        return dequantize(tensor.data, tensor.tensor_type).reshape(shape)

    globals_ = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    globals_["lm_head.weight"] = "token_embd.weight" if cfg.tie_word_embeddings else "output.weight"
    for name, param in model.state_dict().items():
        match = _LAYER.match(name)
        if match is None:
            value = read(globals_[name])
        else:
            index, module, suffix = match.groups()
            parts = []
            for ours, _ in _names(arch, cfg, module, suffix):
                part = read(f"blk.{index}.{ours}")
                if arch.permute_qk and ours.startswith(("attn_q.", "attn_k.")):
                    part = _unpermute(
                        part, cfg.num_attention_heads if ours.startswith("attn_q.") else cfg.num_key_value_heads
                    )
                parts.append(part)
            value = np.concatenate(parts, axis=-2) if len(parts) > 1 else parts[0]
        param.copy_(torch.from_numpy(np.array(value, dtype=np.float32)).reshape(param.shape))


def _unpermute(weights: np.ndarray, heads: int) -> np.ndarray:
    """The inverse of `permute` (llama.cpp's q/k row order back to rotate-half's)."""
    return weights.reshape(heads, -1, 2, *weights.shape[1:]).swapaxes(1, 2).reshape(weights.shape)


def _build(case: str, quantized: bool, qtype: GGMLQuantizationType | None = None, **extra):
    spec, case_qtype, overrides, seed = CASES[case]
    qtype = qtype or case_qtype
    model_type, base = SPECS[spec]
    model = build_hf_model(model_type, {**base, **overrides, **extra}, seed=seed)
    if quantized:
        round_trip(model, qtype)
    return model, qtype if quantized else F32


def _llm(path: Path, compressed: bool) -> LLM:
    return LLM(
        model=str(path),
        dtype="float32",
        max_model_len=MAX_MODEL_LEN,
        num_kv_blocks=32,
        block_size=8,
        quantization="gguf" if compressed else "none",
    )


def _nbytes(weight) -> int:
    return weight.numel() * weight.element_size() if isinstance(weight, torch.Tensor) else weight.nbytes


def _moe_layers(llm: LLM) -> list:
    return [layer for layer in llm.engine.runner.model.layers if layer.moe is not None]


@pytest.fixture
def dequantized(monkeypatch) -> list[str]:
    """The names of the GGUF tensors the loader dequantises (an expert stack must not be one of them when kept)."""
    names: list[str] = []
    original = gguf_loader._dequantized
    monkeypatch.setattr(
        gguf_loader,
        "_dequantized",
        lambda data, qtype, shape, name: names.append(name) or original(data, qtype, shape, name),
    )
    return names


@pytest.mark.parametrize("quantized", [False, True], ids=["f32", "quantized"])
@pytest.mark.parametrize("case", list(CASES))
def test_gguf_moe_matches_transformers(case, quantized, tmp_path, greedy_comparison, dequantized):
    model, qtype = _build(case, quantized)
    path = write_moe_gguf(model, ARCHITECTURES[case], tmp_path / f"{case}.gguf", qtype, flat_shared_gate=quantized)
    reads = quantized and case in TRANSFORMERS_READS
    _check_gguf(case, path, model, quantized, greedy_comparison, dequantized, transformers_reads=reads)


def _check_gguf(case, path: Path, model, quantized: bool, comparison, dequantized, transformers_reads=False) -> None:
    """The file loaded by heteroserve (experts compressed if `quantized`) against transformers: the model given,
    or with `transformers_reads` transformers' GGUF loader on the file (checked to hold the same weights).
    dequantized: the `dequantized` fixture's list."""
    dequantized.clear()
    llm = _llm(path, compressed=quantized)

    hf_config = llm.engine.model.hf_config
    assert hf_config.model_type == model.config.model_type
    assert hf_config.num_hidden_layers == model.config.num_hidden_layers
    layers = _moe_layers(llm)
    assert len(layers) == sum(1 for name in model.state_dict() if name.endswith("mlp.gate.weight"))
    for layer in layers:
        moe = layer.moe
        assert moe.spec.num_experts == len(moe.experts_gate_up)
        weights = [moe.experts_gate_up[0], moe.experts_down[-1]]
        weights += [moe.shared_gate_up] if moe.shared_gate_up is not None else []
        for weight in weights:  # each expert a weight of its own, compressed (as the platform packed it) or float
            rows, columns = weight.shape
            bytes_per_weight = _nbytes(weight) / (rows * columns)
            assert bytes_per_weight < 1.2 if quantized else bytes_per_weight == 4, (type(weight), bytes_per_weight)
    if quantized:
        assert not [name for name in dequantized if "_exps" in name], "an expert stack was dequantised"
        # Our 4-bit (8-bit) forms keep float32 scales and zeros per 32 weights: 0.75 (1.125) bytes a weight and a
        # little more once the platform packed them, against Q4_0's 0.5625 (Q8_0's 1.0625). Float32 experts would be
        # ~7x (~3.8x) the file.
        # Latent attention's kv_b_proj is kept dense float32 by design (absorbed per head; DeepSeek-V2-Lite's are ~2%
        # of its 4-bit file), a large share of these tiny models: it is left out of the bound.
        file_bytes = sum(int(t.n_bytes) for t in GGUFReader(path).tensors)
        ours = llm.engine.runner.model
        latent = [layer.self_attn for layer in ours.layers if isinstance(layer.self_attn, LatentAttention)]
        stored = ours.weight_bytes() - sum(_nbytes(a.w_uk) + _nbytes(a.w_uv) for a in latent)
        assert stored <= 1.5 * file_bytes, f"{stored} bytes loaded from a file of {file_bytes}"

    if transformers_reads:  # transformers dequantises the file itself
        reference = load_reference(path.parent, gguf_file=path.name, config=model.config)
        loaded = reference.model.state_dict()
        for name, tensor in model.state_dict().items():
            assert torch.equal(loaded[name], tensor), name
    else:
        reference = as_reference(model)
    vocab = model.config.vocab_size
    batch = prompts(9, [37, 12], vocab)
    label = f"gguf/{case}/{'quantized' if quantized else 'f32'}"
    for i, (output, prompt) in enumerate(zip(run(llm, batch, greedy_params(vocab)), batch, strict=True)):
        check_output(f"{label}[{i}]", output, prompt, reference, comparison)


@pytest.mark.parametrize(
    "key, value",
    [("attention.temperature_scale", 0.1), ("rope.scaling.yarn_attn_factor", 1.2), ("expert_gating_func", 3)],
)
def test_deepseek_metadata_we_cannot_honour_is_named(key, value, tmp_path):
    """A deepseek2 file's keys that would change its answers and that we do not implement are refused by name."""
    model, _ = _build("deepseek_v3", quantized=False)
    arch = ARCHITECTURES["deepseek_v3"]
    keys = {**arch.keys, key: lambda cfg: value}
    path = write_moe_gguf(model, dataclasses.replace(arch, keys=keys), tmp_path / "tweaked.gguf")
    with pytest.raises(ValueError, match=re.escape(f"deepseek2.{key}")):
        _llm(path, compressed=False)


def test_deepseek_files_before_the_split_kv_b(tmp_path, greedy_comparison, dequantized):
    """A DeepSeek-V2 file as converters wrote them before kv_b_proj was split per head: one attn_kv_b, the heads'
    sizes as key and value lengths and no `*_mla` keys, against transformers."""
    model, _ = _build("deepseek_v2", quantized=False)
    path = write_moe_gguf(model, ARCHITECTURES["deepseek_v2"], tmp_path / "whole_kv_b.gguf", whole_kv_b=True)
    names = {t.name for t in GGUFReader(path).tensors}
    assert "blk.0.attn_kv_b.weight" in names and "blk.0.attn_k_b.weight" not in names
    _check_gguf("deepseek_v2", path, model, False, greedy_comparison, dequantized)


@pytest.mark.parametrize("qtype", sorted(BLOCK_BYTES, key=lambda t: t.value), ids=lambda t: t.name)
def test_every_expert_of_a_stack_reads_its_own_rows(qtype, tmp_path):
    """Each expert of a 3-D stack of every kept block type, read compressed, equals the gguf package's
    dequantisation of the whole stack at that expert (random bytes are valid blocks once their float16 scales
    are finite)."""
    experts, rows, columns = 3, 4, 256
    block = BLOCK_BYTES[qtype]
    gen = np.random.default_rng(qtype.value)
    raw = gen.integers(0, 256, (experts, rows, columns // _block_size(qtype), block), dtype=np.uint8)
    for offset in _scale_offsets(qtype):
        raw[..., offset : offset + 2] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
    path = tmp_path / "stack.gguf"
    writer = GGUFWriter(path, "qwen3moe")
    writer.add_tensor("blk.0.ffn_gate_exps.weight", raw.reshape(experts, rows, -1), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    (tensor,) = GGUFReader(path).tensors
    whole = dequantize(tensor.data, qtype).reshape(experts, rows, columns)
    read = list(gguf_loader._experts(tensor, 0, ("gate_proj",), keep_quantized=True))
    assert [name for name, _ in read] == [f"model.layers.0.mlp.experts.{e}.gate_proj.weight" for e in range(experts)]
    for e, (_, weight) in enumerate(read):
        assert not isinstance(weight, torch.Tensor)
        torch.testing.assert_close(weight.dequantize(), torch.from_numpy(whole[e].astype(np.float32)))


def _block_size(qtype: GGMLQuantizationType) -> int:
    return 256 if qtype.name.endswith("_K") else 32


def _scale_offsets(qtype: GGMLQuantizationType) -> list[int]:
    """Byte offsets of a block's float16 scales (d, and dmin / m where the type has one)."""
    if qtype == GGMLQuantizationType.Q6_K:
        return [208]
    if qtype.name in ("Q4_1", "Q5_1", "Q4_K", "Q5_K"):
        return [0, 2]
    return [0]


@pytest.mark.parametrize(
    "keys, message",
    [
        ({"expert_gating_func": lambda cfg: 1}, "glm4moe.expert_gating_func"),
        ({"leading_dense_block_count": lambda cfg: 0}, "GGUF blocks with experts [1, 2] are not GLM-4.5"),
    ],
    ids=["softmax-scores", "dense-layers"],
)
def test_moe_metadata_we_cannot_honour_is_named(keys, message, tmp_path):
    model, _ = _build("glm4_moe", quantized=False)
    arch = ARCHITECTURES["glm4_moe"]
    path = write_moe_gguf(model, dataclasses.replace(arch, keys={**arch.keys, **keys}), tmp_path / "tweaked.gguf")
    with pytest.raises(ValueError, match=re.escape(message)):
        _llm(path, compressed=False)


# ---- llama.cpp's own converter (opt-in) ------------------------------------------------------------------


@pytest.mark.skipif(LLAMA_CPP is None, reason="set HETEROSERVE_LLAMA_CPP to a llama.cpp source tree")
@pytest.mark.parametrize("case", list(CASES))
def test_llama_cpp_converted_gguf_matches_transformers(case, tmp_path, greedy_comparison, dequantized):
    """The tiny model through llama.cpp's convert_hf_to_gguf.py (f32, and q8_0 kept compressed): the same tensors,
    bytes and `<arch>.*` keys as `write_moe_gguf` writes, and transformers' tokens and logprobs."""
    for quantized in (False, True):
        model, qtype = _build(case, quantized, Q8_0)
        folder = tmp_path / f"{case}_{qtype.name}"
        model.save_pretrained(folder, safe_serialization=True)
        vocab = {f"t{i}": i for i in range(model.config.vocab_size)}  # the converter trims the embedding to it
        (folder / "tokenizer.json").write_text(json.dumps({"model": {"vocab": vocab}, "added_tokens": []}))
        path = tmp_path / f"{case}_{qtype.name}.gguf"
        args = [str(folder), "--outfile", str(path), "--outtype", qtype.name.lower()]
        done = subprocess.run([sys.executable, "-c", _CONVERT, LLAMA_CPP, *args], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-3000:]
        ours = GGUFReader(write_moe_gguf(model, ARCHITECTURES[case], tmp_path / "ours.gguf", qtype))
        theirs = GGUFReader(path)
        mine = {t.name: t for t in ours.tensors}
        # transformers builds no multi-token-prediction block, so the converter has none to write (ours: placeholders)
        layers = model.config.num_hidden_layers
        assert {t.name for t in theirs.tensors} == {n for n in mine if _block_of(n) < layers}
        for tensor in theirs.tensors:
            assert np.array_equal(tensor.data, mine[tensor.name].data), tensor.name
        arch = ARCHITECTURES[case].name
        keys = {k: theirs.fields[k].contents() for k in theirs.fields if k.startswith(arch + ".")}
        assert keys == {k: ours.fields[k].contents() for k in ours.fields if k.startswith(arch + ".")}
        _check_gguf(case, path, model, quantized, greedy_comparison, dequantized)


def _block_of(gguf_name: str) -> int:
    return int(gguf_name.split(".")[1]) if gguf_name.startswith("blk.") else -1


# ---- llama.cpp itself on the same files (opt-in) -----------------------------------------------------------

needs_libllama = pytest.mark.skipif(
    LLAMA_CPP_PYTHON is None or "LLAMA_CPP_LIB_PATH" not in os.environ,
    reason="set HETEROSERVE_LLAMA_CPP_PYTHON (llama-cpp-python's source) and LLAMA_CPP_LIB_PATH (libllama's folder)",
)


@needs_libllama
@pytest.mark.parametrize("case", LIBLLAMA_CASES)
def test_llama_cpp_agrees_on_the_same_gguf(case, tmp_path):
    """heteroserve (experts compressed where the file's are) against llama.cpp's logits on the same file, float32
    closely (every position) and the quantised type loosely (see `_compare_with_llama_cpp`)."""
    for quantized in (False, True):
        model, qtype = _build(case, quantized)
        arch = ARCHITECTURES[case]
        ours = write_moe_gguf(model, arch, tmp_path / f"{qtype.name}.gguf", qtype)
        theirs = write_moe_gguf(model, arch, tmp_path / f"{qtype.name}_vocab.gguf", qtype, vocab=True)
        _compare_with_llama_cpp(f"{case}/{qtype.name}", _llm(ours, compressed=quantized), theirs, quantized)


def _compare_with_llama_cpp(label: str, llm: LLM, theirs: Path, quantized: bool, max_off: float = 0.25) -> None:
    """Our logprobs of a prompt and its greedy continuation against llama.cpp's on `theirs` (the same tensors, with
    a vocabulary). Float32 within 2e-3 of the largest logit everywhere. On quantised files llama.cpp rounds the
    activations to 8 bits, which flips the odd near-tied expert choice and moves that token's logits (and those
    attending to it) by whole units: within 0.15 at the median and at all but `max_off` of the positions."""
    vocab = llm.engine.model.hf_config.vocab_size
    prompt = prompts(9, [37], vocab)[0]
    output = run(llm, [prompt], greedy_params(vocab))[0]
    generated = list(output.outputs[0].token_ids)
    logits = llama_cpp_logits(theirs, prompt + generated[:-1])
    reference = torch.log_softmax(logits, dim=-1)
    mine = _logprobs(output, vocab)
    bound = (0.15 if quantized else 2e-3) * float(logits.abs().max())
    errors = (mine - reference).abs().amax(dim=-1)  # a row per position
    off = errors > bound
    summary = f"{label}: logprobs differ from llama.cpp's by up to {float(errors.max()):.3e}, median "
    summary += f"{float(errors.median()):.3e}, at {int(off.sum())} of {len(errors)} positions over {bound:.3e}"
    assert float(off.float().mean()) <= (max_off if quantized else 0.0), summary
    assert float(errors.median()) <= bound, summary
    top2 = reference.topk(2).values
    for j, token in enumerate(generated):
        at = len(prompt) - 1 + j
        if int(reference[at].argmax()) != token:  # where llama.cpp's top two are close, or an expert flipped
            near = float(top2[at, 0] - top2[at, 1]) <= 2 * bound
            assert near or bool(off[: at + 1].any()), f"{label}: token {j} is not llama.cpp's argmax"
            break


def _logprobs(output, vocab: int) -> torch.Tensor:
    """[positions, vocab]: the prompt's (from its second token) then the completion's."""
    rows = [output.prompt_logprobs[i] for i in range(1, len(output.prompt_token_ids))] + output.outputs[0].logprobs
    return torch.stack([torch.tensor([e[t].logprob for t in range(vocab)]) for e in rows])


# llama.cpp's own quantisation (llama_model_quantize in libllama, what llama-quantize runs) of a float32 file.
_LLAMA_CPP_QUANTIZE = """
import ctypes, sys, types
pkg = types.ModuleType("llama_cpp")
pkg.__path__ = [sys.argv[1] + "/llama_cpp"]
sys.modules["llama_cpp"] = pkg
import llama_cpp.llama_cpp as L
params = L.llama_model_quantize_default_params()
params.ftype, params.nthread = L.LLAMA_FTYPE_MOSTLY_Q4_K_M, 1
assert L.llama_model_quantize(sys.argv[2].encode(), sys.argv[3].encode(), ctypes.byref(params)) == 0
"""
# K-quant blocks are 256 weights long: the models grow so every matrix's rows are (ERNIE's converter then writes
# intermediate / kv heads, 256, as its shared experts' size, which llama.cpp believes).
K_QUANT_SIZES = {"hidden_size": 256, "head_dim": 64, "intermediate_size": 256, "moe_intermediate_size": 256}
K_QUANT_OVERRIDES = {
    "mixtral": {},
    "qwen2_moe": {"shared_expert_intermediate_size": 256},
    "qwen3_moe": {},
    "ernie4_5_moe": {"moe_num_shared_experts": 1, "intermediate_size": 512},
    "glm4_moe": {},
}


@needs_libllama
@pytest.mark.parametrize("case", K_QUANT_CASES)
def test_llama_cpp_q4_k_m_kept_compressed(case, tmp_path, greedy_comparison, dequantized):
    """A float32 file quantised to Q4_K_M by llama.cpp (Q4_K experts, Q6_K down stacks on some layers): experts
    kept compressed at under twice the file's size; kept so, and dequantised at load, the same tokens and logprobs
    as transformers on the file's values, and llama.cpp's within the quantised bounds."""
    model, _ = _build(case, quantized=False, **{**K_QUANT_SIZES, **K_QUANT_OVERRIDES[case]})
    randomize(model, CASES[case][3], std=0.1)  # 4x wider than the tiny models: activations of the same size
    path, theirs = tmp_path / "q4_k_m.gguf", tmp_path / "q4_k_m_vocab.gguf"  # heteroserve reads no byte vocabulary
    for vocab, out in ((False, path), (True, theirs)):
        source = write_moe_gguf(model, ARCHITECTURES[case], tmp_path / f"f32_{vocab}.gguf", vocab=vocab)
        args = [LLAMA_CPP_PYTHON, str(source), str(out)]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        done = subprocess.run(
            [sys.executable, "-c", _LLAMA_CPP_QUANTIZE, *args], capture_output=True, text=True, env=env
        )
        assert done.returncode == 0, done.stderr[-3000:]
    for a, b in zip(GGUFReader(path).tensors, GGUFReader(theirs).tensors, strict=True):
        assert a.name == b.name and np.array_equal(a.data, b.data), a.name
    types = {GGMLQuantizationType(t.tensor_type).name for t in GGUFReader(path).tensors if "_exps" in t.name}
    assert {"Q4_K", "Q6_K"} <= types, types

    llm = _llm(path, compressed=True)
    assert not [name for name in dequantized if "_exps" in name], "an expert stack was dequantised"
    for layer in _moe_layers(llm):
        for weight in (layer.moe.experts_gate_up[0], layer.moe.experts_down[0]):
            rows, columns = weight.shape
            assert _nbytes(weight) / (rows * columns) <= 1.25, type(weight)  # Q6_K: int8 + a scale per 16
    file_bytes = sum(int(t.n_bytes) for t in GGUFReader(path).tensors)
    # Q4_K (Q6_K) blocks are 0.56 (0.82) bytes a weight, our forms 0.75 (1.25): ~1.7x, where float32 would be ~6x.
    assert llm.engine.runner.model.weight_bytes() <= 2 * file_bytes

    # Transformers on the file's own values; llama.cpp rounds activations to 8 bits with one scale per 256 against
    # K-quant blocks, coarser than against Q8_0 / Q4_0: half the positions may be off, the median may not.
    load_gguf_weights(model, ARCHITECTURES[case], path)
    reference, vocab = as_reference(model), model.config.vocab_size
    batch = prompts(9, [37, 12], vocab)
    for kept, engine in (("compressed", llm), ("dequantised", _llm(path, compressed=False))):
        for i, (output, prompt) in enumerate(zip(run(engine, batch, greedy_params(vocab)), batch, strict=True)):
            check_output(f"gguf/{case}/Q4_K_M/{kept}[{i}]", output, prompt, reference, greedy_comparison)
        _compare_with_llama_cpp(f"{case}/Q4_K_M/{kept}", engine, theirs, quantized=True, max_off=0.5)
