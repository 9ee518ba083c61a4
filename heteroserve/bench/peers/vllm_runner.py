"""Runs inside vLLM's own virtualenv (.venv-vllm, which has no heteroserve): `LLM.generate` on batches of token
ids that `bench --peer vllm` sends, one JSON line each, answering each with its wall time and output token ids.

Usage: python vllm_runner.py '{"model": FOLDER, "dtype": "float32", "max_model_len": 2048}'. The model loads once
and a small warm-up runs; then `{"ready": true, "vllm": VERSION}`, and for each line `{"requests": [[PROMPT_IDS,
MAX_TOKENS], ...]}` on stdin one line `{"wall_s": SECONDS, "outputs": [[TOKEN_IDS], ...]}` on stdout, until stdin
closes. Greedy, EOS ignored, prefix caching off. Only these lines reach stdout: vLLM's own prints and logs go to
stderr.
"""

from __future__ import annotations

import json
import os
import sys
import time


def protocol_stream():
    """The process's stdout, kept for the answers; file descriptor 1 then points at stderr for everything else."""
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return answers


def main() -> None:
    answers = protocol_stream()
    settings = json.loads(sys.argv[1])
    import vllm

    llm = vllm.LLM(
        model=settings["model"],
        dtype=settings["dtype"],
        max_model_len=settings["max_model_len"],
        enable_prefix_caching=False,
        seed=0,
    )

    def generate(requests: list[list]) -> tuple[float, list[list[int]]]:
        prompts = [{"prompt_token_ids": prompt} for prompt, _ in requests]
        params = [vllm.SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True) for _, tokens in requests]
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - start
        return wall, [list(output.outputs[0].token_ids) for output in outputs]

    generate([[[1, 2, 3], 2]])  # warm-up, outside any timing
    answers.write(json.dumps({"ready": True, "vllm": vllm.__version__}) + "\n")
    for line in sys.stdin:
        wall, outputs = generate(json.loads(line)["requests"])
        answers.write(json.dumps({"wall_s": wall, "outputs": outputs}) + "\n")


if __name__ == "__main__":
    main()
