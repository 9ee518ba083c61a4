"""vLLM's CPU build as a peer, set up as ../shared/bench/peers.md ran it: its own virtualenv (.venv-vllm, made by
scripts/setup-vllm-peer.sh, since it pins its own torch), the same weights as ours (hf_folder.py), greedy, EOS
ignored, prefix caching off. `LLM.generate` runs in a process of that virtualenv (vllm_runner.py) for a batch
(scenarios B and D) or one stream (A); its OpenAI server for scenario C."""

from __future__ import annotations

import glob
import json
import os
import statistics
import subprocess
import tempfile
from pathlib import Path

import torch

from heteroserve.bench.peers.hf_peer import PeerRun, Requests
from heteroserve.bench.serve import OwnServer
from heteroserve.platforms.cpu.platform import process_threads

RUNNER = Path(__file__).with_name("vllm_runner.py")
KV_CACHE_GIB = 4  # VLLM_CPU_KVCACHE_SPACE: vLLM's CPU KV cache, in GiB, as peers.md's runs had it
SERVED_MODEL_NAME = "vllm-peer"


def vllm_venv() -> Path:
    """vLLM's virtualenv: $HETEROSERVE_VLLM_VENV, or .venv-vllm beside the heteroserve package (where
    scripts/setup-vllm-peer.sh makes it)."""
    return Path(os.environ.get("HETEROSERVE_VLLM_VENV") or Path(__file__).resolve().parents[3] / ".venv-vllm")


def vllm_missing() -> str | None:
    """Why the peer cannot run here, or None."""
    venv = vllm_venv()
    if not (venv / "bin" / "python").exists():
        return f"{venv} does not exist: run scripts/setup-vllm-peer.sh to install vLLM's CPU build there"
    return None


def vllm_environment() -> dict[str, str]:
    """peers.md's settings for vLLM's CPU build: the KV cache space, OpenMP threads bound to as many cores as ours
    use, none reserved, and Debian's tcmalloc and the virtualenv's libiomp5 preloaded where present (vLLM's
    documented CPU set-up)."""
    threads = process_threads()
    env = {
        "VLLM_CPU_KVCACHE_SPACE": str(KV_CACHE_GIB),
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}",
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
    }
    preload = sorted(glob.glob("/usr/lib/*/libtcmalloc_minimal.so.4"))[:1]
    preload += [str(p) for p in [vllm_venv() / "lib" / "libiomp5.so"] if p.is_file()]
    if os.environ.get("LD_PRELOAD"):
        preload.append(os.environ["LD_PRELOAD"])
    if preload:
        env["LD_PRELOAD"] = ":".join(preload)
    return env


def vllm_dtype(dtype: str, folder: Path) -> str:
    """Our --dtype as vLLM's: "auto" is the checkpoint's own dtype, as ours reads it (vLLM's "auto" would run a
    float32 checkpoint in 16 bits)."""
    if dtype != "auto":
        return dtype
    config = json.loads((folder / "config.json").read_text())
    return str(config.get("dtype") or config.get("torch_dtype") or "float32")


class VLLMPeer:
    """`LLM.generate` in a vllm_runner.py process that loads the model once and answers batch after batch."""

    name = "vllm"

    def __init__(self, folder: Path, dtype: torch.dtype, max_model_len: int) -> None:
        dtype_name = str(dtype).removeprefix("torch.")
        self.weights = f"{folder} in {dtype_name}"
        settings = {"model": str(folder), "dtype": dtype_name, "max_model_len": max_model_len}
        self.log = Path(tempfile.mkstemp(prefix="heteroserve-vllm-peer-", suffix=".log")[1])
        print(f"starting vLLM's runner (the first start compiles for minutes; its log: {self.log})")
        with self.log.open("w") as log:
            self.process = subprocess.Popen(
                [str(vllm_venv() / "bin" / "python"), str(RUNNER), json.dumps(settings)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                env={**os.environ, **vllm_environment()},
            )
        self.version = self._answer()["vllm"]

    def _answer(self) -> dict:
        line = self.process.stdout.readline()
        if not line:
            tail = self.log.read_text()[-2000:]
            raise SystemExit(f"vLLM's runner exited with code {self.process.wait()}; the end of {self.log}:\n{tail}")
        return json.loads(line)

    def _generate(self, requests: Requests) -> tuple[float, list[list[int]]]:
        """One `LLM.generate` call over every request at once: its wall time (measured in the runner) and tokens."""
        self.process.stdin.write(json.dumps({"requests": requests}) + "\n")
        self.process.stdin.flush()
        answer = self._answer()
        return answer["wall_s"], answer["outputs"]

    def run_batches(self, requests: Requests, batch_size: int) -> PeerRun:
        """`batch_size` requests submitted at a time (continuous batching within each submission)."""
        wall, outputs = 0.0, []
        for i in range(0, len(requests), batch_size):
            seconds, tokens = self._generate(requests[i : i + batch_size])
            wall += seconds
            outputs += tokens
        return PeerRun(wall, sum(g for _, g in requests), outputs)

    def single_stream(self, prompt: list[int], output_len: int, repeats: int) -> dict[str, float]:
        """Prefill time (a one-token generate) and decode tokens/s, medians over `repeats`."""
        prefill, decode = [], []
        for _ in range(repeats):
            first, _ = self._generate([(prompt, 1)])
            total, _ = self._generate([(prompt, output_len)])
            prefill.append(first)
            decode.append((output_len - 1) / max(total - first, 1e-9))
        return {"prefill_ms": 1000 * statistics.median(prefill), "decode_tokens_per_s": statistics.median(decode)}

    def close(self) -> None:
        """Ends the runner: it exits when its stdin closes (as it does when this process exits)."""
        self.process.stdin.close()
        try:
            self.process.wait(60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def start_vllm_server(folder: Path, dtype: str, max_model_len: int, enable_prefix_caching: bool) -> OwnServer:
    """vLLM's OpenAI server on a free local port, serving `folder` as SERVED_MODEL_NAME (the `vllm` command looks
    for a distribution named vllm, so its module runs instead); the first start compiles for minutes."""
    flags = [
        "--dtype",
        dtype,
        "--max-model-len",
        str(max_model_len),
        "--served-model-name",
        SERVED_MODEL_NAME,
        "--seed",
        "0",
        "--enable-prefix-caching" if enable_prefix_caching else "--no-enable-prefix-caching",
    ]
    return OwnServer(
        str(folder),
        flags,
        startup_timeout=1800,
        command=["vllm.entrypoints.openai.api_server"],
        env=vllm_environment(),
        python=str(vllm_venv() / "bin" / "python"),
        ready_path="/health",
    )
