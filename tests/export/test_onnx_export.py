"""Exported ONNX graphs run by onnxruntime against our engine and transformers.

The tiny random models (tests/model/tiny_models.py) of the families whose layers differ most are exported;
onnxruntime prefills two prompts of different lengths in one padded call and decodes 16 more tokens, the paged
cache laid out by our block manager. Its log-probabilities must equal the engine's (reference operators, float32)
within the bound of `compare_with_engine` at every prompt row and every decode step, its greedy tokens the
engine's and transformers'.
"""

from __future__ import annotations

import contextlib
import io
import json
from dataclasses import dataclass

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from gguf import GGMLQuantizationType
from transformers import AutoImageProcessor

from heteroserve.config import ModelConfig
from heteroserve.entrypoints.cli import main
from heteroserve.export.onnx_export import export_onnx, export_vision
from heteroserve.export.onnx_runner import OnnxDecoder
from heteroserve.export.options import ExportOptions
from heteroserve.model.loader import load_model
from heteroserve.platforms import resolve_platform
from tests.export.onnx_steps import OnnxRun, generate
from tests.model.test_gguf import COMMON_GGUF, write_gguf
from tests.model.tiny_models import (
    VOCAB,
    TinyModel,
    build_hf_model,
    greedy_params,
    load_reference,
    prompts,
    run,
    save_tiny,
)
from tests.model.tiny_vl import TinyVL, image, save_tiny_vl

NEW_TOKENS = 17  # the prefill's token, then 16 decode steps
LOGPROB_TOL = 1e-4  # float32: max |log-probability difference| from the engine
BLOCK_SIZE = 4  # small blocks: every sequence spans several, interleaved with the other's
PROMPT_LENGTHS = [11, 6]  # longer than mistral's 8-token window
VISION_GRID = (1, 10, 14)  # the 200 x 140 test image in 14-pixel patches (Qwen2-VL, Qwen2.5-VL)


def export_tiny(folder, out, quantization: str | None = None, **options) -> OnnxDecoder:
    config = ModelConfig(model=str(folder), dtype="float32", max_model_len=64, quantization=quantization)
    loaded = load_model(config, resolve_platform("cpu"), "reference")
    export_onnx(loaded, ExportOptions(out=out, block_size=BLOCK_SIZE, **options))
    return OnnxDecoder(out, threads=1)


def _dense(entry: dict, vocab: int) -> torch.Tensor:
    assert len(entry) == vocab, f"expected logprobs of all {vocab} tokens, got {len(entry)}"
    return torch.tensor([entry[t].logprob for t in range(vocab)], dtype=torch.float32)


def compare_with_engine(
    label: str, onnx_run: OnnxRun, tiny, comparison, engine: dict | None = None, transformers: bool = True
) -> tuple[float, float]:
    """Asserts onnxruntime's run equals the engine's and transformers'; returns (max |logprob diff|, min top-2
    margin) over every compared row. The margin is reported, not asserted: the logprobs are compared at every row,
    so a near-tie hides no error, and a token divergence at one fails the token check all the same."""
    vocab = tiny.vocab_size
    llm = tiny.llm(kernels="reference", block_size=BLOCK_SIZE, **(engine or {}))
    outputs = run(llm, onnx_run.prompts, greedy_params(vocab, max_tokens=NEW_TOKENS))
    margin = min(onnx_run.margins())
    error, scale = 0.0, 0.0
    for i, (prompt, output) in enumerate(zip(onnx_run.prompts, outputs, strict=True)):
        completion = output.outputs[0]
        assert onnx_run.tokens[i] == list(completion.token_ids), (
            f"{label} sequence {i}: onnxruntime {onnx_run.tokens[i]} != engine {list(completion.token_ids)} "
            f"(smallest top-2 margin {margin:.3f})"
        )
        engine = [_dense(output.prompt_logprobs[j], vocab) for j in range(1, len(prompt))]
        engine += [_dense(entry, vocab) for entry in completion.logprobs]
        ours = torch.cat((onnx_run.prompt_logits[i][:-1], torch.stack(onnx_run.step_logits[i])))
        scale = max(scale, float(ours.abs().max()))
        error = max(error, float((torch.log_softmax(ours, -1) - torch.stack(engine)).abs().max()))
        if transformers:
            reference = tiny.reference.greedy(prompt, NEW_TOKENS)
            comparison.check(f"onnx {label} sequence {i}", onnx_run.tokens[i], reference)
    # Float32 rounding grows with the logits' size (Gemma's embeddings are scaled by sqrt(hidden)): LOGPROB_TOL per
    # 10 units of the largest logit.
    tolerance = LOGPROB_TOL * max(1.0, scale / 10)
    print(f"{label}: max |logprob diff| {error:.2e} (bound {tolerance:.1e}), smallest top-2 logit margin {margin:.2e}")
    assert error <= tolerance, f"{label}: onnxruntime's logprobs differ from the engine's by {error:.3e}"
    return error, margin


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return {name: save_tiny(name, root) for name in EXPORTED}


# The families whose layers differ most: the others' traits are among these (and all are checked against
# transformers in tests/model), which keeps this file's run time in bounds.
EXPORTED = ["llama3", "llama_tied", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "glm4", "granite", "olmo2"]


@pytest.mark.parametrize("name", EXPORTED)
def test_paged_export_matches_engine(name, tiny_models, tmp_path, greedy_comparison):
    tiny = tiny_models[name]
    decoder = export_tiny(tiny.folder, tmp_path / "onnx")
    onnx_run = generate(decoder, prompts(7, PROMPT_LENGTHS), NEW_TOKENS)
    compare_with_engine(f"{name} paged", onnx_run, tiny, greedy_comparison)
    config = json.loads((tmp_path / "onnx" / "config.json").read_text())
    assert config["kv_layout"] == "paged" and config["weights"]["dequantized_from"] == []
    names = [spec["name"] for spec in config["graphs"]["decode"]["inputs"]]
    assert names[:4] == ["input_ids", "positions", "seq_lens", "past_key.0"]
    assert names[-2:] == ["slot_mapping", "block_tables"]


def test_q4_1_gguf_through_the_command_line(tmp_path, greedy_comparison):
    """The default model's path on a tiny one: a tied Llama GGUF of Q4_1 matrices through `heteroserve export
    onnx`, its weights dequantised to float32, against the engine on the same file dequantised at load and
    transformers' own GGUF loader. (The default model itself: test_default_model_export.py, in the slow set.)"""
    model = build_hf_model("llama", {**COMMON_GGUF, "tie_word_embeddings": True}, seed=31)
    (tmp_path / "gguf").mkdir()
    path = write_gguf(model, tmp_path / "gguf" / "tiny-q4_1.gguf", GGMLQuantizationType.Q4_1)
    out = tmp_path / "onnx"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        main(["export", "onnx", str(path), "--out", str(out), "--block-size", str(BLOCK_SIZE), "--max-model-len", "64"])
    assert "dequantised to float32" in printed.getvalue(), printed.getvalue()
    config = json.loads((out / "config.json").read_text())
    assert config["weights"]["dequantized_from"] and config["tokenizer"] is None, config
    tiny = TinyModel("q4_1 gguf", path.parent, load_reference(path.parent, gguf_file=path.name))
    onnx_run = generate(OnnxDecoder(out, threads=1), prompts(7, PROMPT_LENGTHS), NEW_TOKENS)
    compare_with_engine("llama Q4_1 GGUF", onnx_run, tiny, greedy_comparison, {"quantization": "none"})


def test_contiguous_export_matches_engine(tiny_models, tmp_path, greedy_comparison):
    tiny = tiny_models["mistral"]
    decoder = export_tiny(tiny.folder, tmp_path / "onnx", kv_layout="contiguous")
    compare_with_engine(
        "mistral contiguous", generate(decoder, prompts(8, PROMPT_LENGTHS), NEW_TOKENS), tiny, greedy_comparison
    )


def test_static_export_pads_and_rejects_long_inputs(tiny_models, tmp_path, greedy_comparison):
    tiny = tiny_models["qwen2"]
    decoder = export_tiny(tiny.folder, tmp_path / "onnx", static={"batch": 3, "seq": 12, "blocks": 64})
    config = decoder.config
    prefill = {spec["name"]: spec["shape"] for spec in config["graphs"]["prefill"]["inputs"]}
    assert prefill["input_ids"] == [3, 12] and prefill["past_key.0"] == [64, BLOCK_SIZE, 2, 16]
    assert prefill["block_tables"] == [3, 64 // BLOCK_SIZE]
    compare_with_engine(
        "qwen2 static", generate(decoder, prompts(9, PROMPT_LENGTHS), NEW_TOKENS), tiny, greedy_comparison
    )
    with pytest.raises(ValueError, match=r"13 tokens exceed the prefill graph's static seq=12"):
        generate(decoder, prompts(9, [13]), 2)
    with pytest.raises(ValueError, match=r"4 sequences exceed the graph's static batch=3"):
        generate(decoder, prompts(9, [2, 2, 2, 2]), 2)


@dataclass
class TextOfVL:
    """A tiny Qwen2-VL seen as its language model: text prompts only, compared as the text models are."""

    vl: TinyVL

    @property
    def vocab_size(self) -> int:
        return self.vl.model.config.get_text_config().vocab_size

    @property
    def reference(self):
        return self.vl.reference([])

    def llm(self, **kwargs):
        return self.vl.llm(max_model_len=64, num_kv_blocks=64, **kwargs)


def check_vision_graph(label: str, folder, vision, graph, expected_grid: tuple[int, int, int]) -> float:
    """onnxruntime's image embeddings for one image against our encoder's; returns the max |difference|."""
    out = AutoImageProcessor.from_pretrained(folder)(images=[image(1, 200, 140)], return_tensors="pt")
    pixels, grid = out["pixel_values"], tuple(out["image_grid_thw"][0].tolist())
    assert grid == expected_grid, f"the test image's grid is {grid}"
    ours = vision(pixels, grid)
    session = ort.InferenceSession(str(graph), providers=["CPUExecutionProvider"])
    theirs = torch.from_numpy(session.run(None, {"pixel_values": pixels.numpy()})[0])
    error, scale = float((theirs - ours).abs().max()), float(ours.abs().max())
    print(f"{label} vision tower: max |embedding diff| {error:.2e} (largest |value| {scale:.1f})")
    assert theirs.shape == ours.shape and error <= 1e-4 * scale, f"{label}: vision tower differs by {error:.3e}"
    return error


def test_vision_language_model_exports_its_language_model(tmp_path, greedy_comparison):
    vl = save_tiny_vl("qwen2_vl", tmp_path)
    specials = set(vl.tokenizer.all_special_ids)
    text_prompts = [[t for t in p if t not in specials] for p in prompts(10, [12, 7], vocab=VOCAB)]
    decoder = export_tiny(vl.folder, tmp_path / "onnx", vision_grid=VISION_GRID)
    onnx_run = generate(decoder, text_prompts, NEW_TOKENS)
    compare_with_engine("qwen2_vl text paged", onnx_run, TextOfVL(vl), greedy_comparison)
    config = decoder.config
    assert config["model_type"] == "qwen2_vl" and config["tokenizer"] == "tokenizer"
    assert config["vision_tower"] == {"graph": "vision", "grid": list(VISION_GRID)}
    assert config["graphs"]["vision"]["inputs"][0]["shape"] == [140, 1176]
    loaded = load_model(ModelConfig(model=str(vl.folder), dtype="float32"), resolve_platform("cpu"), "reference")
    check_vision_graph("qwen2_vl", vl.folder, loaded.vision, tmp_path / "onnx" / "vision.onnx", VISION_GRID)


@pytest.mark.parametrize("model_type", ["qwen2_5_vl", "qwen3_vl"])
def test_vision_tower_graph(model_type, tmp_path):
    """Qwen2.5-VL's windowed blocks and Qwen3-VL's learned positions and DeepStack outputs, as static graphs."""
    vl = save_tiny_vl(model_type, tmp_path)
    loaded = load_model(ModelConfig(model=str(vl.folder), dtype="float32"), resolve_platform("cpu"), "reference")
    grid = VISION_GRID if model_type == "qwen2_5_vl" else (1, 8, 12)  # 16-pixel patches: the same image
    graph = tmp_path / "vision.onnx"
    export_vision(loaded, ExportOptions(out=tmp_path, vision_grid=grid), graph)
    onnx.checker.check_model(str(graph), full_check=True)
    check_vision_graph(model_type, vl.folder, loaded.vision, graph, grid)


def test_float16_export_runs_close_to_float32(tiny_models, tmp_path, greedy_comparison):
    """A float16 export (weights, activations and cache) on onnxruntime: the engine's float32 logprobs within
    float16's rounding, its greedy tokens up to a near-tie (a wider one, as for a 16-bit KV cache)."""
    tiny = tiny_models["llama_tied"]
    decoder = export_tiny(tiny.folder, tmp_path / "onnx", dtype="float16")
    spec = {s["name"]: s["dtype"] for s in decoder.config["graphs"]["prefill"]["inputs"]}
    assert spec["past_key.0"] == "float16" and decoder.new_caches(num_blocks=2)[0].dtype == np.float16
    token_prompts = prompts(7, PROMPT_LENGTHS)
    onnx_run = generate(decoder, token_prompts, NEW_TOKENS)
    outputs = run(tiny.llm(kernels="reference"), token_prompts, greedy_params(tiny.vocab_size, max_tokens=NEW_TOKENS))
    for i, output in enumerate(outputs):
        engine = torch.stack([_dense(output.prompt_logprobs[j], tiny.vocab_size) for j in range(1, PROMPT_LENGTHS[i])])
        logits = onnx_run.prompt_logits[i][:-1]
        error, scale = float((torch.log_softmax(logits, -1) - engine).abs().max()), float(logits.abs().max())
        print(f"llama_tied float16: max |prompt logprob diff| from float32 {error:.2e} (largest |logit| {scale:.1f})")
        assert error < 1e-2 * scale, f"float16 prompt logprobs differ from float32 by {error:.3e}"
        greedy_comparison.check(
            f"onnx float16 sequence {i}", onnx_run.tokens[i], tiny.reference.greedy(token_prompts[i], NEW_TOKENS), 0.1
        )


def test_int4_weights_as_matmul_nbits(tiny_models, tmp_path, greedy_comparison):
    """Load-time int4 weights kept 4-bit in the graph (onnxruntime's MatMulNBits) against the engine running the
    same int4 weights (transformers has no such model to compare with)."""
    tiny = tiny_models["qwen2"]
    decoder = export_tiny(tiny.folder, tmp_path / "onnx", quantization="int4", int4_weights="matmulnbits")
    weights = decoder.config["weights"]
    assert weights["matmul_nbits_projections"] == 4 * 3 and weights["dequantized_from"] == [], weights
    nodes = onnx.load(str(tmp_path / "onnx" / "prefill.onnx"), load_external_data=False).graph.node
    assert sum(n.op_type == "MatMulNBits" and n.domain == "com.microsoft" for n in nodes) == 4 * 3
    onnx_run = generate(decoder, prompts(7, PROMPT_LENGTHS), NEW_TOKENS)
    engine = {"quantization": "int4"}
    compare_with_engine("qwen2 int4 MatMulNBits", onnx_run, tiny, greedy_comparison, engine, transformers=False)
