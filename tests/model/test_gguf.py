"""GGUF loading against transformers' own GGUF loader, and clear errors for damaged or foreign checkpoints.

The GGUF files are written here from tiny random transformers models the way llama.cpp's
convert_hf_to_gguf.py writes them: llama.cpp tensor names, Llama's Q/K rows permuted, `<arch>.*` keys,
F32 or Q8_0 matrices.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter, LlamaFileType
from gguf.quants import QuantError, quantize
from safetensors.torch import load_file, save_file
from transformers import GPT2Config, GPT2LMHeadModel

from heteroserve import LLM
from tests.model.tiny_models import (
    MAX_MODEL_LEN,
    SPECS,
    as_reference,
    build_hf_model,
    check_output,
    greedy_params,
    load_reference,
    prompts,
    run,
)

COMMON_GGUF = {"rope_parameters": {"rope_type": "default", "rope_theta": 50000.0}, "rms_norm_eps": 1e-6}


def permute(weights: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """llama.cpp's row permutation of Llama Q/K weights (rotate-half pairs -> interleaved pairs).

    Same as `LlamaModel.permute` in llama.cpp's convert_hf_to_gguf.py, applied in its `modify_tensors`
    as permute(q, n_head, n_head) and permute(k, n_head, n_kv_head); see
    https://github.com/ggerganov/llama.cpp/blob/a38b884c6c4b0c256583acfaaabdf556c62fabea/convert_hf_to_gguf.py#L1402-L1408
    """
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (
        weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


_LAYER_TENSORS = {  # llama.cpp name -> transformers module
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


def write_gguf(model, path: Path, qtype: GGMLQuantizationType = GGMLQuantizationType.F32) -> Path:
    """A transformers Llama/Qwen2/Qwen3 as llama.cpp writes it: F32 or Q8_0 matrices, F32 vectors.

    Only Llama's Q/K rows are permuted (llama.cpp runs Qwen with the rotate-half rope). No tokenizer
    metadata: the engine then takes token ids only.
    """
    cfg = model.config
    arch = cfg.model_type
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    sd = {name: t.detach().float().numpy() for name, t in model.state_dict().items()}
    tensors = {
        "token_embd.weight": sd["model.embed_tokens.weight"],
        "output_norm.weight": sd["model.norm.weight"],
    }
    if not cfg.tie_word_embeddings:
        tensors["output.weight"] = sd["lm_head.weight"]
    for i in range(cfg.num_hidden_layers):
        for ours, theirs in _LAYER_TENSORS.items():
            for suffix in ("weight", "bias"):
                value = sd.get(f"model.layers.{i}.{theirs}.{suffix}")
                if value is None:
                    continue
                if arch == "llama" and ours == "attn_q":
                    value = permute(value, heads, heads)
                elif arch == "llama" and ours == "attn_k":
                    value = permute(value, heads, kv_heads)
                tensors[f"blk.{i}.{ours}.{suffix}"] = value

    writer = GGUFWriter(path, arch)
    writer.add_name(f"tiny random {arch}")
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(cfg.head_dim)
    if cfg.head_dim * heads != cfg.hidden_size:  # as convert_hf_to_gguf.py writes an explicit head_dim
        writer.add_key_length(cfg.head_dim)
        writer.add_value_length(cfg.head_dim)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    if cfg.rope_parameters.get("rope_type") == "llama3":
        tensors["rope_freqs.weight"] = llama3_rope_freqs(cfg.rope_parameters, cfg.head_dim)
    write_tensors(writer, tensors, qtype)
    return path


def llama3_rope_freqs(rope: dict, head_dim: int) -> np.ndarray:
    """The divisor of each rotary frequency under Llama 3's scaling, as convert_hf_to_gguf.py writes them into
    rope_freqs: 1 for short wavelengths, `factor` for long ones, a smooth blend between."""
    inv_freq = 1.0 / rope["rope_theta"] ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim)
    context, low, high = rope["original_max_position_embeddings"], rope["low_freq_factor"], rope["high_freq_factor"]
    wavelength = 2 * np.pi / inv_freq
    smooth = (context / wavelength - low) / (high - low)
    blend = 1 / ((1 - smooth) / rope["factor"] + smooth)
    divisors = np.where(wavelength > context / low, rope["factor"], blend)
    return np.where(wavelength < context / high, 1.0, divisors).astype(np.float32)


# Matrices the converter keeps in float32 whatever the file type: routers (mixtures of experts).
FLOAT_MATRICES = ("ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight")


def write_tensors(writer: GGUFWriter, tensors: dict[str, np.ndarray], qtype: GGMLQuantizationType) -> None:
    """The file type, then the tensors (weight matrices and expert stacks in `qtype`, float16 where their rows are
    not whole blocks, the rest float32, as convert_hf_to_gguf.py chooses), and the file is written."""
    quantized = qtype != GGMLQuantizationType.F32
    writer.add_file_type(LlamaFileType.MOSTLY_Q8_0 if quantized else LlamaFileType.ALL_F32)
    for name, value in tensors.items():
        if quantized and value.ndim >= 2 and name.endswith(".weight") and not name.endswith(FLOAT_MATRICES):
            try:
                writer.add_tensor(name, quantize(value, qtype), raw_dtype=qtype)
            except QuantError:  # the converter's fallback
                writer.add_tensor(name, np.ascontiguousarray(value, dtype=np.float16))
        else:
            writer.add_tensor(name, np.ascontiguousarray(value, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


LLAMA3_ROPE = SPECS["llama3"][1]["rope_parameters"]
# name -> (model_type, tied, tensor type, seed, config overrides)
GGUF_MODELS = {
    "llama_f32": ("llama", False, GGMLQuantizationType.F32, 11, {}),
    "llama_q8_0": ("llama", True, GGMLQuantizationType.Q8_0, 12, {}),
    "qwen2_f32": ("qwen2", False, GGMLQuantizationType.F32, 14, {}),
    "qwen3_f32": ("qwen3", True, GGMLQuantizationType.F32, 15, {"head_dim": 32}),
    # Llama 3.1's rope scaling, which llama.cpp's files carry as a rope_freqs tensor of frequency divisors; with
    # head_dim 16 and an original context of 64 the frequencies fall in all three of its regimes.
    "llama3_rope_freqs": ("llama", False, GGMLQuantizationType.F32, 16, {"rope_parameters": LLAMA3_ROPE}),
}


@pytest.fixture(scope="module", params=list(GGUF_MODELS))
def gguf_model(request, tmp_path_factory):
    """(name, transformers model it was written from, GGUF path) for each GGUF_MODELS entry."""
    model_type, tied, qtype, seed, extra = GGUF_MODELS[request.param]
    overrides = {**COMMON_GGUF, "tie_word_embeddings": tied, **extra}
    model = build_hf_model(model_type, overrides, seed=seed)
    return (
        request.param,
        model,
        write_gguf(model, tmp_path_factory.mktemp("gguf") / f"{request.param}.gguf", qtype),
    )


@pytest.fixture(scope="module")
def llama_f32(tmp_path_factory):
    """One intact Llama GGUF for the bad-input tests: (transformers model, GGUF path)."""
    model_type, tied, qtype, seed, _ = GGUF_MODELS["llama_f32"]
    model = build_hf_model(model_type, {**COMMON_GGUF, "tie_word_embeddings": tied}, seed=seed)
    return model, write_gguf(model, tmp_path_factory.mktemp("gguf_llama") / "tiny-llama.gguf", qtype)


def test_gguf_matches_transformers(gguf_model, greedy_comparison):
    name, model, path = gguf_model
    exact = GGUF_MODELS[name][2] == GGMLQuantizationType.F32
    if model.config.model_type == "qwen3" or name == "llama3_rope_freqs":
        # transformers' GGUF loader ignores qwen3.attention.key_length (taking Qwen3Config's default head_dim) and
        # rope_freqs, so the reference here is the (bit-identical, F32) model the file was written from.
        assert exact
        reference = as_reference(model)
    else:
        reference = load_reference(path.parent, gguf_file=path.name)
        assert reference.model.config.tie_word_embeddings == model.config.tie_word_embeddings
        if exact:  # our writer is right: transformers' loader, which undoes the permutation, reads it back
            loaded = reference.model.state_dict()
            for tensor_name, tensor in model.state_dict().items():
                assert torch.equal(loaded[tensor_name], tensor), tensor_name

    vocab = model.config.vocab_size
    llm = LLM(
        model=str(path),
        dtype="float32",
        max_model_len=MAX_MODEL_LEN,
        num_kv_blocks=32,
        block_size=8,
        quantization="none",
    )
    assert llm.get_tokenizer() is None  # no tokenizer metadata: token ids only
    hf_config = llm.engine.model.hf_config
    assert hf_config.model_type == model.config.model_type
    assert hf_config.head_dim == model.config.head_dim
    assert hf_config.tie_word_embeddings == model.config.tie_word_embeddings
    assert hf_config.rope_parameters["rope_theta"] == model.config.rope_parameters["rope_theta"]
    assert hf_config.rms_norm_eps == pytest.approx(1e-6)
    single = prompts(8, [37], vocab)
    _check(name, run(llm, single, greedy_params(vocab)), single, reference, greedy_comparison)
    batch = prompts(9, [5, 33, 12], vocab)
    _check(name, run(llm, batch, greedy_params(vocab)), batch, reference, greedy_comparison)


def _check(label, outputs, token_prompts, reference, comparison) -> None:
    for i, (output, prompt) in enumerate(zip(outputs, token_prompts, strict=True)):
        check_output(f"gguf/{label}[{i}]", output, prompt, reference, comparison)


# ---- bad input -------------------------------------------------------------------------------------


def _load(path: Path | str) -> LLM:
    """Dequantised to float32, as transformers loads a GGUF (4/8-bit execution: tests/quantization)."""
    return LLM(model=str(path), dtype="float32", max_model_len=64, num_kv_blocks=8, quantization="none")


@pytest.fixture(scope="module")
def safetensors_folder(tmp_path_factory) -> Path:
    model = build_hf_model("llama", {"tie_word_embeddings": False}, seed=13)
    folder = tmp_path_factory.mktemp("st") / "tiny"
    model.save_pretrained(folder, safe_serialization=True)
    _load(folder)  # the intact checkpoint loads
    return folder


def _copy(folder: Path, dest: Path) -> Path:
    shutil.copytree(folder, dest)
    return dest


def _truncate(path: Path, keep: int) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: keep if keep >= 0 else len(data) + keep])


@pytest.mark.parametrize("keep", [100, 0.5, -100], ids=["in-metadata", "half", "last-bytes"])
def test_truncated_gguf(llama_f32, tmp_path, keep):
    _, path = llama_f32
    damaged = tmp_path / "damaged.gguf"
    shutil.copy(path, damaged)
    _truncate(damaged, int(keep * damaged.stat().st_size) if isinstance(keep, float) else keep)
    with pytest.raises(ValueError, match=re.escape(str(damaged))):
        _load(damaged)


@pytest.mark.parametrize("keep", [5, 0.5, -4], ids=["in-header-size", "half", "last-bytes"])
def test_truncated_safetensors(safetensors_folder, tmp_path, keep):
    folder = _copy(safetensors_folder, tmp_path / "damaged")
    weights = folder / "model.safetensors"
    _truncate(weights, int(keep * weights.stat().st_size) if isinstance(keep, float) else keep)
    with pytest.raises(ValueError, match=re.escape(str(weights))):
        _load(folder)


def test_folder_that_is_not_a_checkpoint(tmp_path, llama_f32):
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "notes.txt").write_text("not a model")
    with pytest.raises(ValueError, match="is not a checkpoint"):
        _load(empty)

    two = tmp_path / "two_ggufs"
    two.mkdir()
    for name in ("a.gguf", "b.gguf"):
        shutil.copy(llama_f32[1], two / name)
    with pytest.raises(ValueError, match="not exactly one .gguf"):
        _load(two)

    text_file = tmp_path / "weights.bin"
    text_file.write_text("nope")
    with pytest.raises(ValueError, match="not a .gguf file"):
        _load(text_file)

    with pytest.raises(FileNotFoundError, match="does not exist"):
        _load(tmp_path / "does-not-exist")


def test_bad_config_and_no_weights(tmp_path, safetensors_folder):
    broken = _copy(safetensors_folder, tmp_path / "broken_config")
    (broken / "config.json").write_text("{ this is not json")
    with pytest.raises(ValueError, match=r"config\.json is not a usable model config"):
        _load(broken)

    no_weights = _copy(safetensors_folder, tmp_path / "no_weights")
    (no_weights / "model.safetensors").unlink()
    with pytest.raises(ValueError, match=r"no \.safetensors weights"):
        _load(no_weights)


def test_unsupported_architecture(tmp_path):
    folder = tmp_path / "gpt2"
    config = GPT2Config(vocab_size=64, n_positions=64, n_embd=32, n_layer=1, n_head=2, bos_token_id=0, eos_token_id=0)
    GPT2LMHeadModel(config).save_pretrained(folder, safe_serialization=True)
    with pytest.raises(ValueError, match="unsupported architecture 'gpt2'"):
        _load(folder)

    path = tmp_path / "gguf" / "gpt2.gguf"
    path.parent.mkdir()
    writer = GGUFWriter(path, "gpt2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((64, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'gpt2'"):
        _load(path)


def test_missing_and_misshapen_tensors(tmp_path, safetensors_folder):
    tensors = load_file(safetensors_folder / "model.safetensors")
    missing_name = "model.layers.1.mlp.down_proj.weight"
    missing = _copy(safetensors_folder, tmp_path / "missing")
    save_file({k: v for k, v in tensors.items() if k != missing_name}, missing / "model.safetensors")
    with pytest.raises(ValueError, match=re.escape(missing_name)):
        _load(missing)

    bad_name = "model.layers.0.self_attn.k_proj.weight"
    misshapen = _copy(safetensors_folder, tmp_path / "misshapen")
    save_file({**tensors, bad_name: tensors[bad_name][:-1]}, misshapen / "model.safetensors")
    with pytest.raises(ValueError, match=re.escape(bad_name)):
        _load(misshapen)

    extra = _copy(safetensors_folder, tmp_path / "extra")
    save_file({**tensors, "model.layers.0.mlp.extra.weight": torch.zeros(2)}, extra / "model.safetensors")
    with pytest.raises(ValueError, match="model.layers.0.mlp.extra.weight"):
        _load(extra)
