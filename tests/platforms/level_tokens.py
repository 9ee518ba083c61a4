"""The default model's greedy tokens, as shipped (4-bit) and in float32, with the top-2 logprob margin at every
step, printed as JSON: run by test_cpu_levels.py in a process per instruction-set level
($HETEROSERVE_CPU_LEVEL, $ATEN_CPU_CAPABILITY)."""

from __future__ import annotations

import json

import torch

from heteroserve import LLM, SamplingParams
from heteroserve.platforms.cpu import kernels as cpu_kernels

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about paged attention.",
    "List three prime numbers and explain why each is prime.",
]
MAX_TOKENS = 24


def greedy(quantization: str | None) -> list[dict]:
    llm = LLM(max_model_len=256, kv_cache_memory_bytes=32 * 1024**2, quantization=quantization)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)
    runs = []
    for output in llm.chat([[{"role": "user", "content": p}] for p in PROMPTS], params, use_tqdm=False):
        completion = output.outputs[0]
        margins = []
        for step in completion.logprobs:
            top = sorted((lp.logprob for lp in step.values()), reverse=True)
            margins.append(top[0] - top[1])
        runs.append({"tokens": completion.token_ids, "margins": margins})
    return runs


def main() -> None:
    report = {
        "build": cpu_kernels.loaded_build(),
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "int4": greedy(None),
        "float32": greedy("none"),
    }
    print(json.dumps(report))


if __name__ == "__main__":
    main()
