"""Hugging Face transformers as the yardstick: one request at a time and static, left-padded batches."""

from __future__ import annotations

import copy
import statistics
import time
from dataclasses import dataclass

import torch

from heteroserve.model.loader.source import ModelSource
from heteroserve.platforms.cpu.platform import torch_at_process_threads

Requests = list[tuple[list[int], int]]


@dataclass
class PeerRun:
    wall_s: float
    output_tokens: int  # useful tokens: what each request asked for
    outputs: list[list[int]]


class HFPeer:
    name = "hf"

    def __init__(self, source: ModelSource, dtype: torch.dtype = torch.float32) -> None:
        from transformers import AutoModelForCausalLM

        if source.gguf_file is not None:
            model = AutoModelForCausalLM.from_pretrained(source.folder, gguf_file=source.gguf_file.name, dtype=dtype)
        else:
            model = AutoModelForCausalLM.from_pretrained(source.folder, dtype=dtype)
        self.model = model.eval()
        self.weights = f"dequantised to {str(dtype).removeprefix('torch.')}" if source.gguf_file else str(dtype)
        self.pad_id = 0
        self.generation_config = copy.deepcopy(model.generation_config)
        self.generation_config.eos_token_id = None  # EOS ignored: every request yields exactly max_tokens
        self.generation_config.do_sample = False
        self.generation_config.pad_token_id = self.pad_id
        self._generate([[1, 2, 3]], 2)  # warm-up, outside any timing

    @torch.inference_mode()
    def _generate(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        with torch_at_process_threads():
            return self._generate_on_torch_threads(prompts, max_new_tokens)

    def _generate_on_torch_threads(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[self.pad_id] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        config = copy.copy(self.generation_config)
        config.max_new_tokens = max_new_tokens
        out = self.model.generate(ids, attention_mask=mask, generation_config=config)
        return out[:, width:].tolist()

    def run_batches(self, requests: Requests, batch_size: int) -> PeerRun:
        """Static batches in arrival order; each batch runs until its longest request is done."""
        start = time.perf_counter()
        outputs: list[list[int]] = []
        for i in range(0, len(requests), batch_size):
            batch = requests[i : i + batch_size]
            generated = self._generate([p for p, _ in batch], max(g for _, g in batch))
            outputs += [tokens[:g] for tokens, (_, g) in zip(generated, batch, strict=True)]
        wall = time.perf_counter() - start
        return PeerRun(wall, sum(g for _, g in requests), outputs)

    def single_stream(self, prompt: list[int], output_len: int, repeats: int) -> dict[str, float]:
        """Prefill time (a one-token generate) and decode tokens/s, medians over `repeats` after a warm-up."""
        self._generate([prompt], 2)
        prefill, decode = [], []
        for _ in range(repeats):
            start = time.perf_counter()
            self._generate([prompt], 1)
            first = time.perf_counter() - start
            start = time.perf_counter()
            self._generate([prompt], output_len)
            total = time.perf_counter() - start
            prefill.append(first)
            decode.append((output_len - 1) / max(total - first, 1e-9))
        return {"prefill_ms": 1000 * statistics.median(prefill), "decode_tokens_per_s": statistics.median(decode)}
