"""Model sources and load-time settings: the local Hugging Face cache, generation_config.json, dtypes."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from heteroserve import LLM, SamplingParams
from tests.model.tiny_models import prompts, save_tiny


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny("qwen2", tmp_path_factory.mktemp("loading"))


def test_model_id_from_local_hf_cache(tiny, tmp_path, monkeypatch):
    """A model id resolves to a snapshot in the local cache, without network."""
    snapshot = tmp_path / "hub" / "models--acme--tiny-qwen2" / "snapshots" / ("0" * 40)
    shutil.copytree(tiny.folder, snapshot)
    (tmp_path / "hub" / "models--acme--tiny-qwen2" / "refs").mkdir()
    (tmp_path / "hub" / "models--acme--tiny-qwen2" / "refs" / "main").write_text("0" * 40)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    ids = prompts(3, [10])[0]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    cached = LLM("acme/tiny-qwen2", max_model_len=64, num_kv_blocks=16).generate({"prompt_token_ids": ids}, params)
    direct = tiny.llm(max_model_len=64, num_kv_blocks=16).generate({"prompt_token_ids": ids}, params)
    assert cached[0].outputs[0].token_ids == direct[0].outputs[0].token_ids
    with pytest.raises(FileNotFoundError, match="acme/absent"):
        LLM("acme/absent")


def test_generation_config_defaults(tiny, tmp_path):
    folder = tmp_path / "with-generation-config"
    shutil.copytree(tiny.folder, folder)
    (folder / "generation_config.json").write_text(json.dumps({"temperature": 0.0, "max_new_tokens": 5}))
    llm = LLM(str(folder), max_model_len=64, num_kv_blocks=16)
    defaults = llm.get_default_sampling_params()
    assert defaults.temperature == 0.0 and defaults.max_tokens == 5
    out = llm.generate({"prompt_token_ids": prompts(4, [8])[0]}, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 5
    ignored = LLM(str(folder), max_model_len=64, num_kv_blocks=16, generation_config="vllm")
    assert ignored.get_default_sampling_params().temperature == 1.0


def test_dtypes(tiny):
    platform = tiny.llm().engine.platform
    supported = platform.supported_dtypes()
    if torch.bfloat16 in supported:
        llm = tiny.llm(dtype="bfloat16")
        assert llm.engine.model.dtype == torch.bfloat16
        ids = prompts(6, [16])[0]
        out = llm.generate(
            {"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=4, logprobs=1), use_tqdm=False
        )[0]
        reference = torch.log_softmax(tiny.reference.logits(ids)[-1], dim=-1)
        first = out.outputs[0].token_ids[0]
        assert abs(out.outputs[0].logprobs[0][first].logprob - float(reference[first])) < 0.1
    unsupported = [
        name for name, dt in (("float16", torch.float16), ("bfloat16", torch.bfloat16)) if dt not in supported
    ]
    for name in unsupported:
        with pytest.raises(ValueError, match=f"dtype {name} is not supported"):
            tiny.llm(dtype=name)
    assert tiny.llm(dtype="auto").engine.model.dtype == torch.float32  # the checkpoint is float32
