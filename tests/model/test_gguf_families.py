"""GGUF files of every llama.cpp architecture we load, against transformers on the same weights.

Each tiny random model (tests/model/tiny_models.py) is written the way llama.cpp's convert_hf_to_gguf.py
writes its architecture (`CONVENTIONS`: llama.cpp tensor names, q/k rows permuted for the Llama-derived
converters, +1 on Gemma's norms, fused q/k/v and gate/up tensors, `<arch>.*` keys), then loaded by heteroserve
as float32 or kept compressed (Q8_0 / Q4_0, run by the reference kernels). A compressed file is compared with
the transformers model whose matrices went through the same quantisation, so the comparison stays exact.

Where a family's config has what GGUF cannot say, the tiny model takes llama.cpp's fixed value: query scale
head_dim ** -0.5 (Gemma 2/3), a sliding window on five layers in six (Gemma 3), no rotary on every fourth layer
(SmolLM3).

Opt-in: HETEROSERVE_LLAMA_CPP (a llama.cpp source tree, e.g. llama-cpp-python's sdist's vendor/llama.cpp) runs
the same models through llama.cpp's own convert_hf_to_gguf.py first; HETEROSERVE_LLAMA_CPP_PYTHON (llama-cpp-python's
source) with LLAMA_CPP_LIB_PATH (a built libllama's folder) compares with llama.cpp's logits on the same files.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter, RopeScalingType
from gguf.quants import dequantize, quantize

from heteroserve import LLM
from tests.model.remote_code_checkpoints import write_chatglm, write_original_qwen
from tests.model.test_gguf import permute, write_tensors
from tests.model.tiny_models import (
    MAX_MODEL_LEN,
    SPECS,
    as_reference,
    build_hf_model,
    check_output,
    greedy_params,
    prompts,
    run,
)

F32, Q8_0, Q4_0 = GGMLQuantizationType.F32, GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_0
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)\.(weight|bias)$")
_LLAMA_NAMES = {  # transformers module -> llama.cpp tensor (gguf-py's tensor_mapping.py)
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_SANDWICH_NAMES = {  # Gemma 2/3, OLMo 2
    **_LLAMA_NAMES,
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}
_FUSED_NAMES = {**_LLAMA_NAMES, "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"}
_GLM4_NAMES = {**_FUSED_NAMES, "post_self_attn_layernorm": "post_attention_norm", "post_mlp_layernorm": "post_ffw_norm"}


def _rope_dims(writer: GGUFWriter, cfg, factor: float = 1.0) -> None:
    writer.add_rope_dimension_count(int(cfg.head_dim * factor))


def _gemma2(writer: GGUFWriter, cfg) -> None:
    writer.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
    writer.add_final_logit_softcapping(cfg.final_logit_softcapping)
    writer.add_sliding_window(cfg.sliding_window)


def _gemma3(writer: GGUFWriter, cfg) -> None:
    full, sliding = cfg.rope_parameters["full_attention"], cfg.rope_parameters["sliding_attention"]
    writer.add_rope_scaling_type(RopeScalingType.LINEAR)
    writer.add_rope_scaling_factor(full["factor"])
    writer.add_rope_freq_base_swa(sliding["rope_theta"])
    writer.add_sliding_window(cfg.sliding_window)


def _phi3(writer: GGUFWriter, cfg) -> None:
    _rope_dims(writer, cfg, cfg.rope_parameters.get("partial_rotary_factor", 1.0))
    writer.add_rope_scaling_orig_ctx_len(cfg.max_position_embeddings)
    if cfg.sliding_window:
        writer.add_sliding_window(cfg.sliding_window)


def _granite(writer: GGUFWriter, cfg) -> None:
    _rope_dims(writer, cfg)
    writer.add_attention_scale(cfg.attention_multiplier)
    writer.add_embedding_scale(cfg.embedding_multiplier)
    writer.add_residual_scale(cfg.residual_multiplier)
    writer.add_logit_scale(cfg.logits_scaling)


@dataclass(frozen=True)
class Convention:
    """How convert_hf_to_gguf.py writes one architecture."""

    arch: str
    names: dict[str, str]
    metadata: Callable[[GGUFWriter, object], None] = lambda writer, cfg: None
    permute_qk: bool = False  # LlamaModel.permute on q/k weights and biases
    norm_plus_one: bool = False  # Gemma: norm weights + 1
    fuse_qkv: bool = False  # q, k, v rows concatenated into attn_qkv (ChatGLM's query_key_value, Qwen's c_attn)
    rope_theta: bool = True  # Gemma and Gemma 2's converters write no rope.freq_base (llama.cpp's 10000 applies)
    ff_factor: int = 1  # Qwen's intermediate_size counts w1 and w2


CONVENTIONS = {
    "gemma": Convention("gemma", _LLAMA_NAMES, norm_plus_one=True, rope_theta=False),
    "gemma2": Convention("gemma2", _SANDWICH_NAMES, _gemma2, norm_plus_one=True, rope_theta=False),
    "gemma3": Convention("gemma3", _SANDWICH_NAMES, _gemma3, norm_plus_one=True),
    "phi3": Convention("phi3", _FUSED_NAMES, _phi3),
    "chatglm": Convention("chatglm", _FUSED_NAMES, lambda w, cfg: _rope_dims(w, cfg, 0.5), fuse_qkv=True),
    "glm4": Convention("glm4", _GLM4_NAMES, lambda w, cfg: _rope_dims(w, cfg, 0.5)),
    "qwen": Convention("qwen", _LLAMA_NAMES, fuse_qkv=True, ff_factor=2),
    "olmo2": Convention("olmo2", _SANDWICH_NAMES),
    "granite": Convention("granite", _LLAMA_NAMES, _granite, permute_qk=True),
    "smollm3": Convention("smollm3", _LLAMA_NAMES, _rope_dims, permute_qk=True),
    "ernie4_5": Convention("ernie4_5", _LLAMA_NAMES),
}


def write_family_gguf(
    model, convention: Convention, path: Path, qtype: GGMLQuantizationType = F32, vocab: bool = False
) -> Path:
    """The transformers model as convert_hf_to_gguf.py writes `convention.arch`; matrices as `qtype`; with `vocab`,
    a byte-level BPE vocabulary llama.cpp can load (heteroserve then takes token ids only without it)."""
    cfg = model.config
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    sd = {name: t.detach().float().numpy() for name, t in model.state_dict().items()}
    tensors = {"token_embd.weight": sd["model.embed_tokens.weight"], "output_norm.weight": sd["model.norm.weight"]}
    if not cfg.tie_word_embeddings:
        tensors["output.weight"] = sd["lm_head.weight"]
    fused: dict[str, list[np.ndarray]] = {}
    for name, value in sd.items():
        match = _LAYER.match(name)
        if match is None:
            continue
        index, module, suffix = match.groups()
        if convention.fuse_qkv and module in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"):
            fused.setdefault(f"blk.{index}.attn_qkv.{suffix}", [None] * 3)["qkv".index(module[10])] = value
            continue
        ours = convention.names[module]
        if convention.permute_qk and ours == "attn_q":
            value = permute(value, heads, heads)
        elif convention.permute_qk and ours == "attn_k":
            value = permute(value, heads, kv_heads)
        tensors[f"blk.{index}.{ours}.{suffix}"] = value
    tensors |= {name: np.concatenate(parts) for name, parts in fused.items()}
    if convention.norm_plus_one:
        tensors = {name: v + 1.0 if name.endswith("norm.weight") else v for name, v in tensors.items()}

    writer = GGUFWriter(path, convention.arch)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size * convention.ff_factor)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    rope = cfg.rope_parameters.get("full_attention", cfg.rope_parameters)
    if convention.rope_theta:
        writer.add_rope_freq_base(rope["rope_theta"])
    convention.metadata(writer, cfg)
    if vocab:
        _add_byte_vocab(writer, cfg.vocab_size)
    write_tensors(writer, tensors, qtype)
    return path


def _add_byte_vocab(writer: GGUFWriter, size: int) -> None:
    """GPT-2's 256 byte tokens (llama.cpp needs one for a newline), then placeholders."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    tokens = list(bytes_to_unicode().values()) + [f"<t{i}>" for i in range(256, size)]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens[:size])
    writer.add_token_types([1] * size)
    writer.add_token_merges(["! !"])  # llama.cpp refuses a BPE vocabulary without merges
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)


@torch.no_grad()
def round_trip(model, qtype: GGMLQuantizationType) -> None:
    """Matrices replaced by their `qtype` values: the transformers side of a compressed comparison (the blocks run
    along rows, so the converter's row permutations and concatenations commute with it)."""
    for param in model.parameters():
        if param.ndim == 2:
            values = param.detach().numpy()
            param.copy_(torch.from_numpy(dequantize(quantize(values, qtype), qtype).reshape(values.shape)))


_GEMMA3_LAYERS = ["sliding_attention"] * 5 + ["full_attention"]
# The original Qwen as transformers' Qwen2 (tests/model/remote_code_checkpoints.py): no grouped KV heads.
_QWEN = {"tie_word_embeddings": False, "use_sliding_window": False, "num_key_value_heads": 4}
PHI3_PLAIN_ROPE = {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.75}
# case -> (tiny_models SPECS entry or (model_type, overrides), GGUF architecture, tensor type, overrides, seed)
CASES = {
    "gemma_f32": ("gemma", "gemma", F32, {}, 41),
    "gemma2_q8_0": ("gemma2", "gemma2", Q8_0, {"query_pre_attn_scalar": 16}, 42),
    "gemma3_f32": (
        "gemma3",
        "gemma3",
        F32,
        {"query_pre_attn_scalar": 16, "num_hidden_layers": 6, "layer_types": _GEMMA3_LAYERS},
        43,
    ),
    # LongRoPE's factor tensors in GGUF are refused: this Phi-3 has plain partial rotary.
    "phi3_q8_0": ("phi3", "phi3", Q8_0, {"rope_parameters": PHI3_PLAIN_ROPE}, 44),
    "chatglm_q4_0": ("glm", "chatglm", Q4_0, {}, 45),
    "glm4_f32": ("glm4", "glm4", F32, {}, 46),
    "qwen_q4_0": (("qwen2", _QWEN), "qwen", Q4_0, {}, 47),
    "olmo2_f32": ("olmo2", "olmo2", F32, {}, 48),
    "granite_q8_0": ("granite", "granite", Q8_0, {}, 49),
    "smollm3_f32": ("smollm3", "smollm3", F32, {"num_hidden_layers": 4, "no_rope_layers": [1, 1, 1, 0]}, 50),
    "ernie4_5_f32": ("ernie4_5", "ernie4_5", F32, {}, 51),
}


def _build(case: str, qtype: GGMLQuantizationType | None = None, **extra):
    spec, arch, case_qtype, overrides, seed = CASES[case]
    qtype = case_qtype if qtype is None else qtype
    model_type, base = SPECS[spec] if isinstance(spec, str) else spec
    model = build_hf_model(model_type, {**base, **overrides, **extra}, seed=seed)
    if qtype != F32:
        round_trip(model, qtype)
    return model, CONVENTIONS[arch], qtype


def _check_gguf(case: str, path: Path, model, compressed: bool, expected_type: str, comparison) -> None:
    """The GGUF loaded by heteroserve (kept compressed or float32) against the transformers model."""
    llm = LLM(
        model=str(path),
        dtype="float32",
        max_model_len=MAX_MODEL_LEN,
        num_kv_blocks=32,
        block_size=8,
        quantization="gguf" if compressed else "none",
        kernels="reference",
    )
    hf_config = llm.engine.model.hf_config
    assert hf_config.model_type == expected_type
    assert hf_config.head_dim == model.config.head_dim
    assert hf_config.tie_word_embeddings == model.config.tie_word_embeddings
    if compressed:  # the projections stay in their blocks
        layer = llm.engine.runner.model.layers[0]
        assert not isinstance(layer.self_attn.qkv_proj, torch.Tensor)
        assert not isinstance(layer.down_proj, torch.Tensor)
    reference = as_reference(model)
    vocab = model.config.vocab_size
    batch = prompts(9, [37, 12], vocab)
    for i, (output, prompt) in enumerate(zip(run(llm, batch, greedy_params(vocab)), batch, strict=True)):
        check_output(f"gguf/{case}[{i}]", output, prompt, reference, comparison)


@pytest.mark.parametrize("case", list(CASES))
def test_gguf_family_matches_transformers(case, tmp_path, greedy_comparison):
    model, convention, qtype = _build(case)
    path = write_family_gguf(model, convention, tmp_path / f"{case}.gguf", qtype)
    expected_type = "qwen2" if convention.arch == "qwen" else model.config.model_type
    _check_gguf(case, path, model, qtype != F32, expected_type, greedy_comparison)


# ---- llama.cpp's own converter (opt-in) ------------------------------------------------------------------

LLAMA_CPP = os.environ.get("HETEROSERVE_LLAMA_CPP")
# Runs convert_hf_to_gguf.py with each model class's vocabulary step skipped: the tiny models have no tokenizer.
_CONVERT = """
import runpy, sys
root = sys.argv[1]
sys.path[:0] = [root, root + "/gguf-py"]
import conversion
find = conversion.get_model_class
def without_vocab(name, mmproj=False):
    cls = find(name, mmproj)
    return type(cls.__name__, (cls,), {"set_vocab": lambda self: None, "model_arch": cls.model_arch})
conversion.get_model_class = without_vocab
sys.argv = [root + "/convert_hf_to_gguf.py", *sys.argv[2:]]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def _save_for_converter(case: str, model, folder: Path) -> None:
    """The checkpoint folder convert_hf_to_gguf.py reads: the remote-code layout for the original Qwen and
    ChatGLM, and a tokenizer.json with the vocabulary's size where the converter trims the embedding to it."""
    arch = CASES[case][1]
    if arch == "qwen":
        write_original_qwen(model, folder)
    elif arch == "chatglm":
        write_chatglm(model, folder)
    else:
        model.save_pretrained(folder, safe_serialization=True)
    vocab = {f"t{i}": i for i in range(model.config.vocab_size)}
    (folder / "tokenizer.json").write_text(json.dumps({"model": {"vocab": vocab}, "added_tokens": []}))


@pytest.mark.skipif(LLAMA_CPP is None, reason="set HETEROSERVE_LLAMA_CPP to a llama.cpp source tree")
@pytest.mark.parametrize("case", list(CASES))
def test_llama_cpp_converted_gguf_matches_transformers(case, tmp_path, greedy_comparison):
    """As above, the file written by llama.cpp's convert_hf_to_gguf.py (f32, or q8_0 kept compressed)."""
    compressed = CASES[case][2] != F32
    model, convention, _ = _build(case, Q8_0 if compressed else F32)
    folder = tmp_path / case
    _save_for_converter(case, model, folder)
    path = tmp_path / f"{case}.gguf"
    args = [str(folder), "--outfile", str(path), "--outtype", "q8_0" if compressed else "f32"]
    done = subprocess.run([sys.executable, "-c", _CONVERT, LLAMA_CPP, *args], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert GGUFReader(path).fields["general.architecture"].contents() == convention.arch
    expected_type = "qwen2" if convention.arch == "qwen" else model.config.model_type
    _check_gguf(case, path, model, compressed, expected_type, greedy_comparison)


# ---- llama.cpp itself on the same files (opt-in) -----------------------------------------------------------

LLAMA_CPP_PYTHON = os.environ.get("HETEROSERVE_LLAMA_CPP_PYTHON")
# llama.cpp's logits for one sequence through llama-cpp-python's ctypes bindings (its package __init__, which needs
# extra packages, is skipped); LLAMA_CPP_LIB_PATH names the folder of libllama.
_LLAMA_CPP_LOGITS = """
import json, sys, types
pkg = types.ModuleType("llama_cpp")
pkg.__path__ = [sys.argv[1] + "/llama_cpp"]
sys.modules["llama_cpp"] = pkg
import llama_cpp.llama_cpp as L
path, tokens = sys.argv[2], json.loads(sys.argv[3])
L.llama_backend_init()
model = L.llama_model_load_from_file(path.encode(), L.llama_model_default_params())
assert model, "llama.cpp could not load " + path
params = L.llama_context_default_params()
params.n_ctx = params.n_batch = params.n_ubatch = 128
params.n_threads = params.n_threads_batch = 1
params.type_k = params.type_v = L.GGML_TYPE_F32
params.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_DISABLED
ctx = L.llama_init_from_model(model, params)
n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
batch = L.llama_batch_init(len(tokens), 0, 1)
batch.n_tokens = len(tokens)
for i, token in enumerate(tokens):
    batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = token, i, 1, True
    batch.seq_id[i][0] = 0
assert L.llama_decode(ctx, batch) == 0
rows = [L.llama_get_logits_ith(ctx, i)[:n_vocab] for i in range(len(tokens))]
print(json.dumps(rows))
"""


def llama_cpp_logits(path: Path, tokens: list[int]) -> torch.Tensor:
    done = subprocess.run(
        [sys.executable, "-c", _LLAMA_CPP_LOGITS, LLAMA_CPP_PYTHON, str(path), json.dumps(tokens)],
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return torch.tensor(json.loads(done.stdout.splitlines()[-1]))


# What llama.cpp does not run as transformers does: it ignores Phi-3's sliding window (llama.cpp PR 13676) and
# loads no ERNIE 4.5 biases.
LLAMA_CPP_OVERRIDES = {"phi3_q8_0": {"sliding_window": None}, "ernie4_5_f32": {"use_bias": False}}


@pytest.mark.skipif(
    LLAMA_CPP_PYTHON is None or "LLAMA_CPP_LIB_PATH" not in os.environ,
    reason="set HETEROSERVE_LLAMA_CPP_PYTHON (llama-cpp-python's source) and LLAMA_CPP_LIB_PATH (libllama's folder)",
)
@pytest.mark.parametrize("case", list(CASES))
def test_llama_cpp_agrees_on_the_same_gguf(case, tmp_path):
    """heteroserve's greedy tokens and logprobs against llama.cpp's logits on the file (with a vocabulary, which
    llama.cpp needs; heteroserve reads the same tensors): float32 closely (llama.cpp's GELU is a float16 table),
    the case's compressed type loosely, since llama.cpp rounds activations to 8 bits against Q8_0 / Q4_0 weights."""
    model, convention, qtype = _build(case, F32, **LLAMA_CPP_OVERRIDES.get(case, {}))
    _compare_with_llama_cpp(case, model, convention, F32, tmp_path, tolerance=2e-3)
    if CASES[case][2] != F32:
        model, convention, qtype = _build(case, **LLAMA_CPP_OVERRIDES.get(case, {}))
        _compare_with_llama_cpp(case, model, convention, qtype, tmp_path, tolerance=0.15)


def _compare_with_llama_cpp(case: str, model, convention, qtype, tmp_path: Path, tolerance: float) -> None:
    label = f"{case}/{qtype.name}"
    ours = write_family_gguf(model, convention, tmp_path / f"{qtype.name}.gguf", qtype)
    theirs = write_family_gguf(model, convention, tmp_path / f"{qtype.name}_vocab.gguf", qtype, vocab=True)
    llm = LLM(model=str(ours), dtype="float32", max_model_len=MAX_MODEL_LEN, num_kv_blocks=32, block_size=8)
    vocab = model.config.vocab_size
    prompt = prompts(9, [37], vocab)[0]
    output = run(llm, [prompt], greedy_params(vocab, prompt_logprobs=False))[0]
    generated = list(output.outputs[0].token_ids)
    logits = llama_cpp_logits(theirs, prompt + generated[:-1])[len(prompt) - 1 :]
    reference = torch.log_softmax(logits, dim=-1)
    mine = torch.stack([torch.tensor([e[t].logprob for t in range(vocab)]) for e in output.outputs[0].logprobs])
    bound = tolerance * float(logits.abs().max())
    error = float((mine - reference).abs().max())
    assert error <= bound, f"{label}: logprobs differ from llama.cpp's by {error:.3e} (tolerance {bound:.3e})"
    top2 = reference.topk(2).values
    for j, token in enumerate(generated):
        if int(reference[j].argmax()) != token:  # only where llama.cpp's top two are within the bound
            assert float(top2[j, 0] - top2[j, 1]) <= 2 * bound, f"{label}: token {j} is not llama.cpp's argmax"
            break  # the sequences part here


# ---- what a GGUF may say that we cannot honour ---------------------------------------------------------


def _with_key(tmp_path: Path, add: Callable[[GGUFWriter], None]) -> Path:
    model, convention, _ = _build("glm4_f32")

    def metadata(writer: GGUFWriter, cfg) -> None:
        convention.metadata(writer, cfg)
        add(writer)

    tweaked = Convention(**{**convention.__dict__, "metadata": metadata})
    return write_family_gguf(model, tweaked, tmp_path / "tweaked.gguf")


@pytest.mark.parametrize(
    "add, message",
    [
        (lambda w: w.add_string("glm4.rope.scaling.type", "yarn"), "glm4.rope.scaling.type 'yarn'"),
        (lambda w: w.add_uint32("glm4.expert_count", 8), "glm4.expert_count"),
        (lambda w: w.add_uint32("glm4.attention.sliding_window", 8), "glm4.attention.sliding_window"),
    ],
    ids=["yarn", "experts", "window"],
)
def test_unsupported_gguf_metadata_is_named(tmp_path, add, message):
    path = _with_key(tmp_path, add)
    with pytest.raises(ValueError, match=re.escape(message)):
        LLM(model=str(path), dtype="float32", max_model_len=64, num_kv_blocks=8, quantization="none")
