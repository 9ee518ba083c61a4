"""The default model (SmolLM2-135M: 9 query heads, 3 KV heads) split over tensor-parallel ranks: 2 ranks hold
uneven shares (1 KV head + 3 query heads, and 2 + 6), 3 ranks (the 4-bit test) one KV group each."""

from __future__ import annotations

import json

import jsonschema
import pytest

from heteroserve import LLM, SamplingParams
from heteroserve.structured_output import StructuredOutputsParams
from tests.reference import NEAR_TIE

MAX_TOKENS = 12
PROMPTS = ["The capital of France is", "def quicksort(arr):\n", "1, 1, 2, 3, 5, 8, 13,"]
ENGINE = {"max_model_len": 256, "kv_cache_memory_bytes": 16 * 1024**2}
CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}, "population": {"type": "integer", "minimum": 0}},
    "required": ["city", "population"],
    "additionalProperties": False,
}


def _greedy(llm: LLM, prompts: list[list[int]], max_tokens: int = MAX_TOKENS, logprobs: int | None = None):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=logprobs)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


@pytest.fixture(scope="module")
def prompt_ids(default_tokenizer) -> list[list[int]]:
    return [default_tokenizer.encode(p) for p in PROMPTS]


@pytest.mark.parametrize("speculative", [None, {"method": "ngram", "num_speculative_tokens": 4}])
def test_tensor_parallel_2_float_matches_transformers(speculative, hf_default, prompt_ids, greedy_comparison):
    """With n-gram drafts, the drafts travel to the worker processes with each step."""
    max_tokens = MAX_TOKENS if speculative is None else 32
    llm = LLM(tensor_parallel_size=2, quantization="none", speculative_config=speculative, **ENGINE)
    try:
        outputs = _greedy(llm, prompt_ids, max_tokens)
        if speculative is not None:
            assert llm.engine.scheduler.num_accepted_tokens > 0
        # The grammar's masks travel to the workers with the step (the sampling rank applies them).
        structured = SamplingParams(temperature=0, max_tokens=60, structured_outputs=StructuredOutputsParams(json=CITY))
        city = llm.generate([{"prompt_token_ids": prompt_ids[0]}], structured, use_tqdm=False)[0].outputs[0]
    finally:
        llm.shutdown()
    jsonschema.validate(json.loads(city.text), CITY)
    for i, (output, prompt) in enumerate(zip(outputs, prompt_ids, strict=True)):
        reference = hf_default.greedy(prompt, max_tokens)
        label = f"default tp=2{' ngram' if speculative else ''} [{i}]"
        greedy_comparison.check(label, list(output.outputs[0].token_ids), reference)


@pytest.mark.slow
def test_tensor_parallel_3_int4_matches_one_rank(prompt_ids):
    """4-bit weights are sliced in packed form: the same tokens as one rank, up to a near-tie of its own logits."""
    single = LLM(**ENGINE)
    expected = _greedy(single, prompt_ids, logprobs=2)
    split = LLM(tensor_parallel_size=3, **ENGINE)
    try:
        got = _greedy(split, prompt_ids)
    finally:
        split.shutdown()
    for want, have in zip(expected, got, strict=True):
        want_ids, have_ids = want.outputs[0].token_ids, have.outputs[0].token_ids
        for j, (a, b) in enumerate(zip(want_ids, have_ids, strict=True)):
            if a != b:
                top2 = sorted((lp.logprob for lp in want.outputs[0].logprobs[j].values()), reverse=True)
                assert top2[0] - top2[1] < NEAR_TIE, f"token {j}: {b} instead of {a} with a clear margin"
                break
