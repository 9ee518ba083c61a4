"""--moe-experts-device cpu on the CPU platform: the experts already run there, so the flag changes nothing (said in
the log), and a model without experts refuses it. Beside a device, tests/platforms/test_simulated_device.py runs
the routed experts on the CPU platform next to the simulated accelerator."""

from __future__ import annotations

import logging

import pytest

from tests.model.tiny_models import greedy_params, prompts, run, save_tiny


def test_on_the_cpu_the_flag_changes_nothing(tmp_path, caplog):
    tiny = save_tiny("qwen2_moe", tmp_path)
    token_prompts = prompts(4, [5, 12], tiny.vocab_size)
    params = greedy_params(tiny.vocab_size, prompt_logprobs=False, max_tokens=8)
    with caplog.at_level(logging.INFO, logger="heteroserve.model.loader"):
        flagged = run(tiny.llm(moe_experts_device="cpu"), token_prompts, params)
    assert "the platform is the CPU, where the experts run with the rest" in caplog.text
    plain = run(tiny.llm(), token_prompts, params)
    assert [o.outputs[0].token_ids for o in flagged] == [o.outputs[0].token_ids for o in plain]


def test_a_model_without_experts_refuses_the_flag(tmp_path):
    dense = save_tiny("qwen2", tmp_path)
    with pytest.raises(ValueError, match="--moe-experts-device cpu: qwen2 has no mixture-of-experts layers"):
        dense.llm(moe_experts_device="cpu")
