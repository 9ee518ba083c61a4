"""llama.cpp (through llama-cpp-python) as a peer: the same GGUF file, or its float copy when our engine runs the
weights dequantised (gguf_float.py), one request at a time, greedy, EOS ignored.

llama-cpp-python's Python API runs one sequence per context, so only the one-at-a-time baseline exists here;
llama.cpp's own server and `llama-batched-bench` are the way to measure its batching (peers.md cites them).
"""

from __future__ import annotations

import statistics
import time

import torch

from heteroserve.bench.peers.gguf_float import float_gguf
from heteroserve.bench.peers.hf_peer import PeerRun, Requests
from heteroserve.model.loader.source import ModelSource
from heteroserve.platforms.cpu.platform import process_threads


def llama_cpp_missing() -> str | None:
    """Why the peer cannot run here, or None."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return "llama-cpp-python is not installed (pip install llama-cpp-python, or the project's [llama-cpp] extra)"
    return None


class LlamaCppPeer:
    name = "llama-cpp"

    def __init__(self, source: ModelSource, context_len: int, float_dtype: torch.dtype | None) -> None:
        """float_dtype: None runs the file's own tensor types (Q4_1 for the default model); float32 or bfloat16
        runs a copy dequantised to that type."""
        from llama_cpp import Llama

        if source.gguf_file is None:
            raise SystemExit("--peer llama-cpp runs GGUF files: give a .gguf model")
        if float_dtype is None:
            path, self.weights = source.gguf_file, f"{source.gguf_file.name} as stored"
        else:
            path = float_gguf(source.gguf_file, float_dtype)
            self.weights = f"{source.gguf_file.name} dequantised to {str(float_dtype).removeprefix('torch.')}"
        self.model = Llama(
            model_path=str(path),
            n_ctx=context_len,
            n_threads=process_threads(),
            verbose=False,
        )
        self._generate([1, 2, 3], 2)  # warm-up, outside any timing

    def _generate(self, prompt: list[int], max_new_tokens: int) -> tuple[list[int], list[float]]:
        """Greedy tokens and the time each arrived; the prompt is never taken from the previous call's cache."""
        self.model.reset()
        tokens, stamps = [], []
        for token in self.model.generate(prompt, temp=0.0, top_k=1, repeat_penalty=1.0, reset=True):
            tokens.append(token)
            stamps.append(time.perf_counter())
            if len(tokens) == max_new_tokens:
                break
        return tokens, stamps

    def run_batches(self, requests: Requests, batch_size: int) -> PeerRun:
        if batch_size != 1:
            raise SystemExit("--peer llama-cpp runs one request at a time (its Python API has no static batches)")
        start = time.perf_counter()
        outputs = [self._generate(prompt, output_len)[0] for prompt, output_len in requests]
        return PeerRun(time.perf_counter() - start, sum(g for _, g in requests), outputs)

    def single_stream(self, prompt: list[int], output_len: int, repeats: int) -> dict[str, float]:
        """Prefill time (to the first token) and decode tokens/s, medians over `repeats` after a warm-up."""
        self._generate(prompt, 2)
        prefill, decode = [], []
        for _ in range(repeats):
            start = time.perf_counter()
            _, stamps = self._generate(prompt, output_len)
            prefill.append(stamps[0] - start)
            decode.append((len(stamps) - 1) / max(stamps[-1] - stamps[0], 1e-9))
        return {"prefill_ms": 1000 * statistics.median(prefill), "decode_tokens_per_s": statistics.median(decode)}
