"""GGUF files: architecture and hyper-parameters from the metadata, tensors dequantised with `gguf`.

Tensor names follow llama.cpp's convention (blk.N.attn_q, ...). llama.cpp's converter permutes the rows
of Llama query/key weights so that rotary pairs are interleaved; we undo it to get the Hugging Face
layout that our rotary embedding (rotate-half) expects.
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

from heteroserve.quantization.ggml import BLOCK_BYTES, ggml_weight
from heteroserve.quantization.int4 import Int4Weight
from heteroserve.quantization.int8 import Int8Weight

GGUF_ARCHITECTURES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3"}
_PERMUTED_QK = {"llama", "mistral"}

_LAYER_TENSORS = {
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
_GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


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


def _field(reader: GGUFReader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def gguf_config(reader: GGUFReader) -> PretrainedConfig:
    arch = _field(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: {', '.join(GGUF_ARCHITECTURES)}")
    names = {t.name for t in reader.tensors}
    num_heads = _field(reader, f"{arch}.attention.head_count")
    hidden = _field(reader, f"{arch}.embedding_length")
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = _field(reader, f"{arch}.vocab_size") or (len(tokens.data) if tokens else None)
    if vocab is None:
        vocab = next(t.shape[1] for t in reader.tensors if t.name == "token_embd.weight")
    kwargs = {
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": _field(reader, f"{arch}.feed_forward_length"),
        "num_hidden_layers": _field(reader, f"{arch}.block_count"),
        "num_attention_heads": num_heads,
        "num_key_value_heads": _field(reader, f"{arch}.attention.head_count_kv", num_heads),
        "head_dim": _field(reader, f"{arch}.attention.key_length", hidden // num_heads),
        "max_position_embeddings": _field(reader, f"{arch}.context_length", 4096),
        "rms_norm_eps": _field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6),
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": _field(reader, f"{arch}.rope.freq_base", 10000.0),
        },
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
    }
    if arch == "mistral":
        kwargs["sliding_window"] = _field(reader, f"{arch}.attention.sliding_window")
    return AutoConfig.for_model(GGUF_ARCHITECTURES[arch], **kwargs)


def _hf_name(gguf_name: str) -> str:
    base, _, suffix = gguf_name.rpartition(".")
    if base.startswith("blk."):
        _, index, kind = base.split(".", 2)
        if kind not in _LAYER_TENSORS:
            raise ValueError(f"unexpected GGUF tensor {gguf_name!r}")
        return f"model.layers.{index}.{_LAYER_TENSORS[kind]}.{suffix}"
    if base not in _GLOBAL_TENSORS:
        raise ValueError(f"unexpected GGUF tensor {gguf_name!r}")
    return f"{_GLOBAL_TENSORS[base]}.{suffix}"


def _unpermute_rotary_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's row permutation: (head, pair, half) -> (head, half, pair) order."""
    rows = weight.shape[0]
    return weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


# Tensors a matrix product reads.
_LINEAR_SUFFIXES = (
    "attn_q.weight",
    "attn_k.weight",
    "attn_v.weight",
    "attn_output.weight",
    "ffn_gate.weight",
    "ffn_up.weight",
    "ffn_down.weight",
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
    """HF-named weights; with `keep_quantized`, see `kept_compressed` (everything else is dequantised)."""
    arch = _field(reader, "general.architecture")
    for tensor in reader.tensors:
        name = _hf_name(tensor.name)
        permuted = arch in _PERMUTED_QK and tensor.name.endswith(("attn_q.weight", "attn_k.weight"))
        heads = config.num_attention_heads if "attn_q" in tensor.name else config.num_key_value_heads
        if keep_quantized and kept_compressed(tensor):
            weight = ggml_weight(tensor_type(tensor), tensor.data, int(tensor.shape[1]))
            if permuted:
                order = _unpermute_rotary_rows(np.arange(weight.shape[0]), heads)
                weight = weight.permute_rows(torch.from_numpy(order.copy()))
            yield name, weight
            continue
        qtype = tensor_type(tensor)
        try:
            values = dequantize(tensor.data, qtype)
        except (NotImplementedError, ValueError) as exc:
            raise ValueError(f"GGUF tensor {tensor.name!r} has unsupported type {qtype.name}: {exc}") from exc
        values = np.asarray(values, dtype=np.float32).reshape(tuple(int(d) for d in reversed(tensor.shape)))
        if permuted:
            values = _unpermute_rotary_rows(values, heads)
        yield name, torch.from_numpy(np.array(values, dtype=np.float32))  # writable copy
