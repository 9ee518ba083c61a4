"""`--peer vllm` without vLLM: the skip when its virtualenv is absent, and our side of the runner's protocol (the
runner itself, run with a stand-in `vllm` module that answers by a fixed rule; vLLM's numbers are not tested)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from heteroserve.bench.harness import runnable_peers
from heteroserve.bench.peers.vllm_peer import VLLMPeer, vllm_dtype
from heteroserve.bench.throughput_command import _configurations

REPO = Path(__file__).resolve().parents[2]

# Answers each prompt with its own tokens reversed, repeated up to max_tokens; records what it was given.
FAKE_VLLM = """
import json, os
from types import SimpleNamespace

__version__ = "0.0+stand-in"


class SamplingParams:
    def __init__(self, temperature, max_tokens, ignore_eos):
        assert temperature == 0 and ignore_eos
        self.max_tokens = max_tokens


class LLM:
    def __init__(self, **settings):
        if os.environ.get("STAND_IN_FAILS"):
            raise RuntimeError("the stand-in refuses to load")
        print("vLLM's noise on stdout")
        env = {k: v for k, v in os.environ.items() if k.startswith("VLLM_CPU_")}
        with open(os.environ["STAND_IN_RECORD"], "w") as f:
            json.dump({"settings": settings, "env": env}, f)

    def generate(self, prompts, params, use_tqdm):
        assert use_tqdm is False and len(prompts) == len(params)
        outputs = []
        for prompt, param in zip(prompts, params):
            tokens = prompt["prompt_token_ids"][::-1] * param.max_tokens
            outputs.append(SimpleNamespace(outputs=[SimpleNamespace(token_ids=tuple(tokens[: param.max_tokens]))]))
        return outputs
"""


@pytest.fixture
def stand_in(tmp_path, monkeypatch) -> Path:
    """A 'virtualenv' whose python is this interpreter with the stand-in `vllm` on its path; the record file."""
    (tmp_path / "site" / "vllm").mkdir(parents=True)
    (tmp_path / "site" / "vllm" / "__init__.py").write_text(FAKE_VLLM)
    python = tmp_path / "venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    python.chmod(0o755)
    monkeypatch.setenv("HETEROSERVE_VLLM_VENV", str(tmp_path / "venv"))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "site"))
    monkeypatch.setenv("STAND_IN_RECORD", str(tmp_path / "record.json"))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the runner's log
    return tmp_path / "record.json"


def expected(prompt: list[int], max_tokens: int) -> list[int]:
    return (prompt[::-1] * max_tokens)[:max_tokens]


def test_runner_answers_batches_in_order(stand_in, tmp_path):
    peer = VLLMPeer(tmp_path / "model", torch.float32, 256)
    try:
        assert peer.version == "0.0+stand-in"
        requests = [([5, 6, 7], 4), ([8], 2), ([9, 10], 5)]
        run = peer.run_batches(requests, 2)  # two submissions: requests 0-1, then 2
        assert run.outputs == [expected(p, g) for p, g in requests]
        assert run.output_tokens == 11 and run.wall_s >= 0
        figures = peer.single_stream([1, 2, 3], 8, 2)
        assert set(figures) == {"prefill_ms", "decode_tokens_per_s"}
    finally:
        peer.close()
    assert peer.process.returncode == 0
    record = json.loads(stand_in.read_text())
    assert record["settings"] == {
        "model": str(tmp_path / "model"),
        "dtype": "float32",
        "max_model_len": 256,
        "enable_prefix_caching": False,
        "seed": 0,
    }
    assert record["env"]["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0" and record["env"]["VLLM_CPU_KVCACHE_SPACE"] == "4"
    assert record["env"]["VLLM_CPU_OMP_THREADS_BIND"].startswith("0-")


def test_runner_that_fails_to_load_says_why(stand_in, tmp_path, monkeypatch):
    monkeypatch.setenv("STAND_IN_FAILS", "1")
    with pytest.raises(SystemExit, match="the stand-in refuses to load"):
        VLLMPeer(tmp_path / "model", torch.float32, 256)


def test_peer_is_skipped_without_its_virtualenv(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HETEROSERVE_VLLM_VENV", str(tmp_path / "absent"))
    engine = SimpleNamespace(config=SimpleNamespace(model=SimpleNamespace(model=None)))
    result: dict = {"peers": {}}
    assert list(runnable_peers(engine, argparse.Namespace(peer=["vllm"]), result)) == []
    assert "scripts/setup-vllm-peer.sh" in result["peers"]["vllm"]["skipped"]
    assert "skipping the vllm peer" in capsys.readouterr().out


def test_vllm_runs_every_request_at_once():
    args = argparse.Namespace(hf_batch="1,8")
    assert _configurations("vllm", args, 64) == [("vllm_all_at_once", 64)]
    assert _configurations("hf", args, 64) == [("hf_one_at_a_time", 1), ("hf_static_8", 8)]


def test_auto_dtype_is_the_checkpoints(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"dtype": "float32"}))
    assert vllm_dtype("auto", tmp_path) == "float32"
    assert vllm_dtype("bfloat16", tmp_path) == "bfloat16"


def test_setup_script_parses():
    subprocess.run(["bash", "-n", str(REPO / "scripts" / "setup-vllm-peer.sh")], check=True)
