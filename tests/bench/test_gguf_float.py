"""The float copy of a GGUF file the llama-cpp peer runs under `--quantization none` (bench/gguf_float.py): read
back by transformers' GGUF loader, it holds what that loader makes of the quantised original, in float32 exactly
and in bfloat16 rounded to nearest; the metadata carries over with the new file type; the copy is made once."""

from __future__ import annotations

import gguf
import pytest
import torch
from gguf import GGMLQuantizationType
from transformers import AutoModelForCausalLM

from heteroserve.bench.peers.gguf_float import float_gguf
from tests.model.test_gguf import COMMON_GGUF, write_gguf
from tests.model.tiny_models import build_hf_model


@pytest.fixture(scope="module")
def q8_file(tmp_path_factory):
    model = build_hf_model("llama", {**COMMON_GGUF, "tie_word_embeddings": True}, seed=12)
    return write_gguf(model, tmp_path_factory.mktemp("q8") / "tiny-q8_0.gguf", GGMLQuantizationType.Q8_0)


def _state(path):
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    return model.state_dict()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_float_copy_holds_the_dequantised_weights(q8_file, dtype, tmp_path):
    copy = float_gguf(q8_file, dtype, cache=tmp_path)
    reader = gguf.GGUFReader(copy)
    matrices = {t.tensor_type for t in reader.tensors if len(t.shape) > 1}
    vectors = {t.tensor_type for t in reader.tensors if len(t.shape) == 1}
    expected = GGMLQuantizationType.F32 if dtype == torch.float32 else GGMLQuantizationType.BF16
    assert matrices == {expected} and vectors == {GGMLQuantizationType.F32}
    assert reader.fields["general.file_type"].contents() == (0 if dtype == torch.float32 else 32)
    original = gguf.GGUFReader(q8_file)
    kept = {n: f.contents() for n, f in original.fields.items() if n != "general.file_type"}
    assert {n: f.contents() for n, f in reader.fields.items() if n in kept} == kept

    theirs, ours = _state(q8_file), _state(copy)
    assert theirs.keys() == ours.keys()
    for name, value in theirs.items():
        want = value.to(dtype).float() if value.dim() > 1 else value
        assert torch.equal(ours[name], want), name

    stamp = copy.stat().st_mtime_ns
    assert float_gguf(q8_file, dtype, cache=tmp_path) == copy and copy.stat().st_mtime_ns == stamp
    assert not list(tmp_path.glob(".staging-*"))
