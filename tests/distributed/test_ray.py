"""Ranks placed as Ray actors (a local Ray instance, started by the test). Slow: Ray takes ~30 s to start.

Run: python -m pytest tests/distributed/test_ray.py -m slow
"""

from __future__ import annotations

import pytest

from tests.model.tiny_models import greedy_params, prompts, run, save_tiny

ray = pytest.importorskip("ray")


@pytest.mark.slow
def test_ray_tensor_parallel_matches_transformers(tmp_path, greedy_comparison):
    tiny = save_tiny("qwen2", tmp_path)
    ray.init(num_cpus=2, include_dashboard=False)
    try:
        llm = tiny.llm(tensor_parallel_size=2, distributed_executor_backend="ray")
        token_prompts = prompts(5, [7, 18], tiny.vocab_size)
        outputs = run(llm, token_prompts, greedy_params(tiny.vocab_size, prompt_logprobs=False, max_tokens=8))
        for i, (output, prompt) in enumerate(zip(outputs, token_prompts, strict=True)):
            reference = tiny.reference.greedy(prompt, 8)
            greedy_comparison.check(f"ray tp=2 [{i}]", list(output.outputs[0].token_ids), reference)
        llm.shutdown()
    finally:
        ray.shutdown()
