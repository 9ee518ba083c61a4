"""GGUF tensor types kept compressed (Q4_0 ... Q6_K) against the `gguf` package's own dequantisation, and a
tiny GGUF model mixing every type against the same file dequantised (quantization="none").

gguf has no quantiser for K-quants, so blocks are random bytes with their float16 scale fields set to small
values: every bit pattern of the other fields is a valid block, which exercises each bit of the layout.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGUFWriter
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize

from heteroserve import LLM, SamplingParams
from heteroserve.platforms.operators import LinearOp
from heteroserve.quantization.ggml import BLOCK_BYTES, ggml_weight
from heteroserve.quantization.int4 import Int4Weight
from heteroserve.quantization.int8 import Int8Weight
from tests.model.tiny_models import prompts
from tests.quantization.test_gptq import relative_error

# Byte offsets of each type's float16 fields (d, and m or dmin) within a block.
_F16_FIELDS = {T.Q4_0: (0,), T.Q4_1: (0, 2), T.Q5_0: (0,), T.Q5_1: (0, 2), T.Q8_0: (0,), T.Q4_K: (0, 2)}
_F16_FIELDS |= {T.Q5_K: (0, 2), T.Q6_K: (208,)}


def random_blocks(qtype: T, rows: int, cols: int, rng: np.random.Generator, magnitude: float) -> np.ndarray:
    """Raw bytes [rows, bytes] of a `qtype` tensor with random integers and scales around `magnitude`."""
    per_block = 256 if qtype in (T.Q4_K, T.Q5_K, T.Q6_K) else 32
    blocks = rng.integers(0, 256, (rows, cols // per_block, BLOCK_BYTES[qtype]), dtype=np.uint8)
    for offset in _F16_FIELDS[qtype]:
        values = rng.uniform(-magnitude, magnitude, blocks.shape[:2]).astype(np.float16)
        blocks[..., offset : offset + 2] = values[..., None].view(np.uint8)
    return blocks.reshape(rows, -1)


@pytest.mark.parametrize("qtype", list(BLOCK_BYTES), ids=lambda t: t.name)
def test_ggml_blocks_decode_as_gguf_does(qtype):
    rng = np.random.default_rng(int(qtype))
    raw = random_blocks(qtype, 64, 512, rng, 0.05)
    weight = ggml_weight(qtype, raw, 64)
    assert isinstance(weight, Int4Weight if qtype in (T.Q4_0, T.Q4_1, T.Q4_K) else Int8Weight)
    reference = torch.from_numpy(dequantize(raw, qtype))
    ours = weight.dequantize()
    assert float((ours - reference).abs().max()) <= 1e-6 * float(reference.abs().max())
    x = torch.randn(3, 512)
    assert relative_error(LinearOp()(x, weight), x @ reference.T) <= 1e-5
    assert weight.nbytes < 0.4 * reference.numel() * 4  # compressed: under 40% of float32, scales included


# Per layer, the type of each projection: every kept type, a Q4_K_M-like mix (q/k Q4_K beside a Q6_K v) and
# float ones.
LAYER_TYPES = [
    {"attn_q": T.Q4_K, "attn_k": T.Q4_K, "attn_v": T.Q6_K, "attn_output": T.Q5_K},
    {"attn_q": T.Q5_0, "attn_k": T.Q5_0, "attn_v": T.Q5_0, "attn_output": T.Q5_1},
    {"attn_q": T.Q8_0, "attn_k": T.Q8_0, "attn_v": T.Q8_0, "attn_output": T.F16},
]
MLP_TYPES = [
    {"ffn_gate": T.Q4_K, "ffn_up": T.Q4_K, "ffn_down": T.Q6_K},
    {"ffn_gate": T.Q4_0, "ffn_up": T.Q4_0, "ffn_down": T.Q4_1},
    {"ffn_gate": T.BF16, "ffn_up": T.BF16, "ffn_down": T.Q8_0},
]
HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 256, 512, 4, 2, 64, 320


def _tensor(writer: GGUFWriter, name: str, qtype: T, shape: tuple[int, int], rng, magnitude: float) -> None:
    rows, cols = shape
    if qtype in BLOCK_BYTES:
        writer.add_tensor(name, random_blocks(qtype, rows, cols, rng, magnitude), raw_dtype=qtype)
        return
    if qtype not in (T.F16, T.BF16):  # a type we do not read: any bytes will do
        block, size = GGML_QUANT_SIZES[qtype]
        writer.add_tensor(name, rng.integers(0, 256, (rows, cols // block * size), dtype=np.uint8), raw_dtype=qtype)
        return
    values = rng.normal(0, 0.05, shape).astype(np.float32)
    if qtype == T.F16:
        writer.add_tensor(name, values.astype(np.float16))
    else:  # BF16: the top half of each float32
        writer.add_tensor(name, (values.view(np.uint32) >> 16).astype(np.uint16), raw_shape=shape, raw_dtype=T.BF16)


def write_mixed_gguf(path: Path, override: dict[str, T] | None = None, embedding: T = T.Q6_K) -> Path:
    """Untied with a Q6_K embedding and a Q5_K head; with a 4-bit `embedding`, tied (it is also the head)."""
    rng = np.random.default_rng(3)
    writer = GGUFWriter(path, "llama")
    for key, value in (("context_length", 256), ("embedding_length", HIDDEN), ("block_count", 3)):
        getattr(writer, f"add_{key}")(value)
    writer.add_feed_forward_length(INTER)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_dimension_count(HEAD_DIM)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_vocab_size(VOCAB)
    tied = embedding in (T.Q4_0, T.Q4_1, T.Q4_K)
    _tensor(writer, "token_embd.weight", embedding, (VOCAB, HIDDEN), rng, 0.003 if tied else 0.02)  # rows looked up
    writer.add_tensor("output_norm.weight", np.ones(HIDDEN, np.float32))
    if not tied:
        _tensor(writer, "output.weight", T.Q5_K, (VOCAB, HIDDEN), rng, 0.003)
    shapes = {"attn_q": (HEADS * HEAD_DIM, HIDDEN), "attn_k": (KV_HEADS * HEAD_DIM, HIDDEN)}
    shapes |= {"attn_v": (KV_HEADS * HEAD_DIM, HIDDEN), "attn_output": (HIDDEN, HEADS * HEAD_DIM)}
    shapes |= {"ffn_gate": (INTER, HIDDEN), "ffn_up": (INTER, HIDDEN), "ffn_down": (HIDDEN, INTER)}
    for i, types in enumerate(zip(LAYER_TYPES, MLP_TYPES, strict=True)):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(HIDDEN, np.float32))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(HIDDEN, np.float32))
        for kind, qtype in (types[0] | types[1]).items():
            qtype = (override or {}).get(f"blk.{i}.{kind}", qtype)
            _tensor(writer, f"blk.{i}.{kind}.weight", qtype, shapes[kind], rng, 0.003)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module", params=[T.Q6_K, T.Q4_K], ids=["q6_k-embedding", "q4_k-tied-embedding"])
def mixed_gguf(request, tmp_path_factory):
    return write_mixed_gguf(tmp_path_factory.mktemp("ggml") / "mixed.gguf", embedding=request.param)


def _logprobs(llm: LLM, ids: list[int]) -> torch.Tensor:
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1, prompt_logprobs=VOCAB), use_tqdm=False)
    return torch.stack([torch.tensor([e[t].logprob for t in range(VOCAB)]) for e in out[0].prompt_logprobs[1:]])


@pytest.mark.parametrize("kernels, tolerance", [("reference", 1e-4), ("auto", 5e-2)])
def test_mixed_gguf_kept_compressed_matches_its_dequantised_self(mixed_gguf, kernels, tolerance):
    kwargs = {"max_model_len": 128, "num_kv_blocks": 16, "kernels": kernels}
    quantized, float_model = LLM(str(mixed_gguf), **kwargs), LLM(str(mixed_gguf), quantization="none", **kwargs)
    model = quantized.engine.runner.model
    assert not isinstance(model.embed_tokens, torch.Tensor)  # compressed, rows dequantised per lookup
    if kernels == "reference":  # every K-quant / Q5 / Q8 projection stays compressed
        assert not isinstance(model.layers[1].self_attn.qkv_proj, torch.Tensor)
        assert not isinstance(model.layers[0].down_proj, torch.Tensor)
        assert model.weight_bytes() < 0.5 * float_model.engine.runner.model.weight_bytes()
    ids = prompts(9, [30], VOCAB)[0]
    ours, theirs = _logprobs(quantized, ids), _logprobs(float_model, ids)
    assert float((ours - theirs).abs().max()) <= tolerance * max(1.0, float(theirs.abs().max()))


def test_unsupported_gguf_type_names_the_tensor(tmp_path):
    path = write_mixed_gguf(tmp_path / "q8_1.gguf", {"blk.1.ffn_up": T.Q8_1})  # no dequantiser anywhere for Q8_1
    with pytest.raises(ValueError, match="GGUF tensor 'blk.1.ffn_up.weight' has unsupported type Q8_1"):
        LLM(str(path), max_model_len=16, num_kv_blocks=4)
