"""GGUF files: architecture and hyper-parameters from the metadata, tensors kept compressed or dequantised.

Tensor names follow llama.cpp's convention (blk.N.attn_q, ...); each architecture's names, config keys and the
converter's transforms to undo (Llama's q/k row permutation, Gemma's +1 norms, fused q/k/v) are data in
gguf_architectures.py, so what leaves here is a Hugging Face checkpoint of the family, for canonical_tensors.
A 3-D stack of experts leaves as one weight per expert, each read from its own rows of the file (compressed,
or dequantised alone), so the whole stack is never expanded at once.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize
from transformers import AutoConfig, PretrainedConfig

from heteroserve.model.loader.canonical_tensors import split_rows
from heteroserve.model.loader.gguf_architectures import (
    CORRECTION_BIAS,
    EXPERT_STACKS,
    GLOBAL_TENSORS,
    LATENT_KEYS,
    LATENT_KV_B,
    LATENT_VALUES,
    GGUFArchitecture,
    Metadata,
    gguf_architecture,
)
from heteroserve.quantization.ggml import BLOCK_BYTES, ggml_weight
from heteroserve.quantization.int4 import Int4Weight
from heteroserve.quantization.int8 import Int8Weight

# Metadata keys whose meaning no family here implements: refused rather than ignored.
_REFUSED_KEYS = {
    "rope.dimension_sections": "M-RoPE sections",
    "rope.scaling.yarn_ext_factor": "a YaRN extrapolation factor",
    "rope.scaling.yarn_attn_factor": "a YaRN attention factor",
    "rope.scaling.attn_factor": "a rotary attention factor",
    "attention.temperature_scale": "attention temperature scaling (Mistral Large 3's deepseek2 files)",
    "expert_group_scale": "a per-group expert scale",
}
# llama.cpp's per-frequency divisors of the rotary (the Llama 3 scaling, as its converter writes it).
ROPE_FREQS = "rope_freqs.weight"


def open_gguf(path: Path) -> GGUFReader:
    """The file's reader, parsed once per process while the file is unchanged: parsing the default model's metadata
    (a 49k-token vocabulary, field by field) takes seconds, and an engine reads the file for its limits, its
    config and its weights. The reader maps the file read-only."""
    try:
        stat = path.stat()
        return _read_gguf(str(path.resolve()), stat.st_size, stat.st_mtime_ns)
    except Exception as exc:  # the reader raises assorted errors on damaged files
        raise ValueError(f"cannot read GGUF file {path}: {exc} (truncated or not a GGUF file?)") from exc


@functools.lru_cache(maxsize=2)
def _read_gguf(path: str, size: int, mtime_ns: int) -> GGUFReader:
    """Keyed by size and modification time too, so a file rewritten in place is parsed again."""
    return GGUFReader(path)


def forget_open_files() -> None:
    """Drops the parsed readers once a model is loaded, and with them the file's mapping: the pages read through
    it count in the process's resident memory, the file's size again beside the converted weights."""
    _read_gguf.cache_clear()


def _field(reader: GGUFReader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def reader_architecture(reader: GGUFReader) -> tuple[str, GGUFArchitecture]:
    """`general.architecture` and its table entry (the variant with experts where `<arch>.expert_count` says so)."""
    name = _field(reader, "general.architecture")
    return name, gguf_architecture(name, _field(reader, f"{name}.expert_count", 0))


def gguf_config(reader: GGUFReader) -> PretrainedConfig:
    """The transformers config of the file's family, from the `<arch>.*` keys (gguf_architectures.py)."""
    arch_name, arch = reader_architecture(reader)

    def get(key: str, default=None):
        return _field(reader, f"{arch_name}.{key}", default)

    for key, what in _REFUSED_KEYS.items():
        if get(key):
            raise ValueError(f"GGUF key {arch_name}.{key} ({what}) is not supported")
    names = frozenset(t.name for t in reader.tensors)
    num_heads = get("attention.head_count")
    hidden = get("embedding_length")
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = get("vocab_size") or (len(tokens.data) if tokens else None)
    if vocab is None:
        vocab = next(t.shape[1] for t in reader.tensors if t.name == "token_embd.weight")
    head_dim = get("attention.key_length", hidden // num_heads)
    common = {
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": get("feed_forward_length"),
        "num_hidden_layers": get("block_count"),
        "num_attention_heads": num_heads,
        "num_key_value_heads": get("attention.head_count_kv", num_heads),
        "head_dim": head_dim,
        "max_position_embeddings": get("context_length", 4096),
        # The converter writes the original Qwen's epsilon under layer_norm_epsilon, although its norm is RMS.
        "rms_norm_eps": get("attention.layer_norm_rms_epsilon") or get("attention.layer_norm_epsilon", 1e-6),
        "rope_parameters": _rope_parameters(arch_name, get, head_dim, ROPE_FREQS in names, arch.yarn),
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
    }
    shapes = {t.name: tuple(int(d) for d in reversed(t.shape)) for t in reader.tensors}
    extra = arch.config(Metadata(get, names, common, shapes))
    if get("attention.sliding_window") and "sliding_window" not in extra:
        raise ValueError(f"GGUF key {arch_name}.attention.sliding_window is not supported for this architecture")
    model_type = extra.pop("model_type", arch.model_type)  # where one architecture is several families (DeepSeek)
    config = AutoConfig.for_model(model_type, **{**common, **extra})
    rope_freqs = _rope_freqs(reader)
    if rope_freqs is not None:  # each rotary frequency divided by its factor (layers/rotary.py)
        config.rope_frequency_divisors = rope_freqs
    return config


def _rope_freqs(reader: GGUFReader) -> list[float] | None:
    tensor = next((t for t in reader.tensors if t.name == ROPE_FREQS), None)
    return None if tensor is None else _load(tensor, False).float().flatten().tolist()


def _rope_parameters(arch_name: str, get, head_dim: int, rope_freqs: bool, yarn: bool) -> dict:
    """rope.freq_base, a linear scaling (or YaRN's frequencies where the architecture reads YaRN), and a partial
    rotary where rope.dimension_count is under head_dim."""
    params = {"rope_type": "default", "rope_theta": get("rope.freq_base", 10000.0)}
    scaling = get("rope.scaling.type", "none")
    if scaling in ("linear", "yarn") and rope_freqs:
        raise ValueError(
            f"GGUF key {arch_name}.rope.scaling.type {scaling} beside a {ROPE_FREQS} tensor is not supported"
        )
    if scaling == "linear":
        params = {**params, "rope_type": "linear", "factor": get("rope.scaling.factor")}
    elif scaling == "yarn" and yarn:
        params |= {
            "rope_type": "yarn",
            "factor": get("rope.scaling.factor"),
            "original_max_position_embeddings": get("rope.scaling.original_context_length"),
            "beta_fast": get("rope.scaling.yarn_beta_fast", 32.0),  # llama.cpp's defaults, and transformers'
            "beta_slow": get("rope.scaling.yarn_beta_slow", 1.0),
        }
    elif scaling != "none":
        supported = "none, linear, yarn" if yarn else "none, linear"
        raise ValueError(f"GGUF key {arch_name}.rope.scaling.type {scaling!r} is not supported ({supported} are)")
    rotary_dim = get("rope.dimension_count", head_dim)
    if rotary_dim != head_dim:
        params["partial_rotary_factor"] = rotary_dim / head_dim
    return params


def _hf_name(gguf_name: str, arch: GGUFArchitecture) -> str:
    base, _, suffix = gguf_name.rpartition(".")
    if base.startswith("blk."):
        _, index, kind = base.split(".", 2)
        if kind == CORRECTION_BIAS[0] and arch.moe:
            return f"model.layers.{index}.{CORRECTION_BIAS[1]}"
        if kind == "attn_qkv" and arch.split_qkv:
            return f"model.layers.{index}.attn_qkv.{suffix}"  # split by iterate_gguf
        if kind not in arch.layer_tensors:
            raise ValueError(f"unexpected GGUF tensor {gguf_name!r}")
        return f"model.layers.{index}.{arch.layer_tensors[kind]}.{suffix}"
    if base not in GLOBAL_TENSORS:
        raise ValueError(f"unexpected GGUF tensor {gguf_name!r}")
    return f"{GLOBAL_TENSORS[base]}.{suffix}"


def _unpermute_rotary_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's row permutation: (head, pair, half) -> (head, half, pair) order."""
    rows = weight.shape[0]
    return weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


# Tensors a matrix product reads.
_LINEAR_SUFFIXES = (
    "attn_qkv.weight",
    "attn_q.weight",
    "attn_k.weight",
    "attn_v.weight",
    "attn_output.weight",
    "attn_q_a.weight",
    "attn_q_b.weight",
    "attn_kv_a_mqa.weight",
    "ffn_gate.weight",
    "ffn_up.weight",
    "ffn_down.weight",
    "ffn_gate_shexp.weight",
    "ffn_up_shexp.weight",
    "ffn_down_shexp.weight",
    "output.weight",
)


def tensor_type(tensor) -> GGMLQuantizationType:
    try:
        return GGMLQuantizationType(tensor.tensor_type)
    except ValueError as exc:
        raise ValueError(f"GGUF tensor {tensor.name!r} has unknown type {tensor.tensor_type!r}") from exc


def kept_compressed(tensor) -> bool:
    """Projections and the token embedding (looked up by rows) of every type `ggml_weight` reads."""
    return tensor_type(tensor) in BLOCK_BYTES and tensor.name.endswith((*_LINEAR_SUFFIXES, "token_embd.weight"))


def iterate_gguf(
    reader: GGUFReader, config: PretrainedConfig, keep_quantized: bool = False
) -> Iterator[tuple[str, torch.Tensor | Int4Weight | Int8Weight]]:
    """HF-named weights in the Hugging Face layout; with `keep_quantized`, see `kept_compressed` (everything else is
    dequantised). The converter's transforms are undone (gguf_architectures.py). Blocks past the model's layers
    (GLM-4.5's multi-token prediction) are skipped."""
    _, arch = reader_architecture(reader)
    tensors = {t.name: t for t in reader.tensors}
    for tensor in reader.tensors:
        block, kind = _block(tensor.name)
        if (block is not None and block >= config.num_hidden_layers) or tensor.name == ROPE_FREQS:
            continue  # rope_freqs is read into the config (gguf_config)
        if kind in EXPERT_STACKS:
            yield from _experts(tensor, block, EXPERT_STACKS[kind], keep_quantized)
            continue
        if kind == LATENT_KEYS:  # with its values' half, which is skipped below
            values = tensors.get(tensor.name.replace(LATENT_KEYS, LATENT_VALUES))
            if values is None:
                raise ValueError(f"GGUF tensor {tensor.name!r} has no {LATENT_VALUES} beside it")
            yield _hf_name(f"blk.{block}.{LATENT_KV_B}.weight", arch), _joined_kv_b(tensor, values)
            continue
        if kind == LATENT_VALUES:
            continue
        name = _hf_name(tensor.name, arch)
        value = _load(tensor, keep_quantized)
        if arch.permuted_qk and (".attn_q." in tensor.name or ".attn_k." in tensor.name):
            heads = config.num_attention_heads if ".attn_q." in tensor.name else config.num_key_value_heads
            value = _unpermute(value, heads)
        if arch.norm_offset and tensor.name.endswith("norm.weight"):
            value = value - arch.norm_offset
        if kind == "ffn_gate_inp_shexp" and value.ndim == 1:  # Qwen2-MoE's shared-expert gate, if stored flat
            value = value[None]
        if arch.split_qkv and ".attn_qkv." in tensor.name:
            d = config.head_dim
            sizes = [config.num_attention_heads * d, config.num_key_value_heads * d, config.num_key_value_heads * d]
            prefix, suffix = name.split(".attn_qkv.")
            for part, rows in zip("qkv", split_rows(value, sizes), strict=True):
                yield f"{prefix}.self_attn.{part}_proj.{suffix}", rows
            continue
        yield name, value


def _block(gguf_name: str) -> tuple[int | None, str | None]:
    """(N, kind) of a `blk.N.kind.suffix` name; (None, None) for a global tensor."""
    if not gguf_name.startswith("blk."):
        return None, None
    _, index, rest = gguf_name.split(".", 2)
    return int(index), rest.rpartition(".")[0]


def _experts(tensor, block: int, projections: tuple[str, ...], keep_quantized: bool):
    """Each expert of a stack [experts, rows, columns] (torch order) under its Hugging Face name. Quantised blocks
    run along a row, so expert e is the stack's rows e * rows ... (e + 1) * rows: its bytes alone are read."""
    qtype = tensor_type(tensor)
    columns, rows, count = (int(d) for d in tensor.shape)
    compressed = keep_quantized and qtype in BLOCK_BYTES
    for e in range(count):
        data = tensor.data[e]
        if compressed:
            value = ggml_weight(qtype, data, rows)
        else:
            value = _dequantized(data, qtype, (rows, columns), tensor.name)
        parts = split_rows(value, [rows // len(projections)] * len(projections)) if len(projections) > 1 else [value]
        for projection, part in zip(projections, parts, strict=True):
            yield f"model.layers.{block}.mlp.experts.{e}.{projection}.weight", part


def _joined_kv_b(keys, values) -> torch.Tensor:
    """Latent attention's kv_b_proj [heads * (nope + v), kv_lora_rank] from llama.cpp's attn_k_b [heads, kv_lora_rank,
    nope] and attn_v_b [heads, v, kv_lora_rank]: each head's key rows, then its value rows (dense float32, as the
    model keeps it)."""
    k_b, v_b = _load(keys, False), _load(values, False)
    if k_b.ndim != 3 or v_b.ndim != 3 or k_b.shape[:2] != (v_b.shape[0], v_b.shape[2]):
        raise ValueError(f"GGUF tensors {keys.name!r} {tuple(k_b.shape)} and {values.name!r} {tuple(v_b.shape)} differ")
    return torch.cat([k_b.transpose(1, 2), v_b], dim=1).reshape(-1, k_b.shape[1]).contiguous()


def _load(tensor, keep_quantized: bool) -> torch.Tensor | Int4Weight | Int8Weight:
    if keep_quantized and kept_compressed(tensor):
        return ggml_weight(tensor_type(tensor), tensor.data, int(tensor.shape[1]))
    shape = tuple(int(d) for d in reversed(tensor.shape))
    return _dequantized(tensor.data, tensor_type(tensor), shape, tensor.name)


def _dequantized(data: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, ...], name: str) -> torch.Tensor:
    try:
        values = dequantize(data, qtype)
    except (NotImplementedError, ValueError) as exc:
        raise ValueError(f"GGUF tensor {name!r} has unsupported type {qtype.name}: {exc}") from exc
    values = np.asarray(values, dtype=np.float32).reshape(shape)
    return torch.from_numpy(np.array(values, dtype=np.float32))  # writable copy


def _unpermute(value, heads: int):
    """Rows (of a weight or a bias) back in the Hugging Face order."""
    order = torch.from_numpy(_unpermute_rotary_rows(np.arange(value.shape[0]), heads).copy())
    if isinstance(value, torch.Tensor):
        return value[order].contiguous()
    return value.permute_rows(order)
