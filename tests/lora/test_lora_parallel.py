"""Adapters over ranks: with tensor parallelism each rank holds the adapter's rows or columns that match its share
of the projections, with pipeline parallelism its stage's layers; both against peft's merged models. Each engine
starts worker processes (~15 s on 2 cores)."""

from __future__ import annotations

import pytest

from tests.model.tiny_models import check_output, greedy_params, prompts

NEW_TOKENS = 8


@pytest.mark.parametrize("parallel", [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}], ids=["tp2", "pp2"])
def test_adapters_over_two_ranks(base, adapters, greedy_comparison, parallel):
    llm = base.llm(enable_lora=True, max_loras=2, **parallel)
    try:
        token_prompts = prompts(17, [5, 23, 12, 30])
        choices = [None, adapters[0], adapters[1], adapters[3]]  # all modules; q/v only; rsLoRA on attention
        outputs = llm.generate(
            [{"prompt_token_ids": p} for p in token_prompts],
            greedy_params(base.vocab_size, max_tokens=NEW_TOKENS),
            use_tqdm=False,
            lora_request=[c and c.request for c in choices],
        )
        for output, prompt, choice in zip(outputs, token_prompts, choices, strict=True):
            reference = base.reference if choice is None else choice.reference
            label = f"{next(iter(parallel))}/{choice.request.lora_name if choice else 'base'}"
            check_output(label, output, prompt, reference, greedy_comparison, max_tokens=NEW_TOKENS)
    finally:
        llm.shutdown()
