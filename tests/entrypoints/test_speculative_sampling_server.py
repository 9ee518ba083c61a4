"""Speculative sampling through the server at temperature 0.7: a served tiny model drafted by an unrelated tiny
model (its drafts refused: the residual distribution does the work; a sampler that kept them would give the
draft's paths) and by its own 4-bit copy (about a third kept: both branches), 2400 seeded requests of four tokens
from the official client, their paths against the exact distribution of plain sampling (transformers' logits,
top-3 at temperature 0.7) by a chi-square test. The engine-level test (tests/engine/test_draft_model.py) checks the same
sampler on every draft; this one checks that requests reaching it through the API keep its distribution."""

from __future__ import annotations

import asyncio
import json
from collections import Counter

import openai
import pytest

from tests.engine.test_draft_model import SAMPLED_TOKENS, SAMPLED_TOP_K, SAMPLES, chi_square, path_probabilities
from tests.entrypoints.server_process import ServerProcess
from tests.model.tiny_models import build_hf_model, prompts, save_tiny

TEMPERATURE = 0.7


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    return save_tiny("qwen2", tmp_path_factory.mktemp("spec-sampling-served"))


@pytest.fixture(scope="module", params=["other", "self-int4"])
def draft_server(request, served, tmp_path_factory):
    draft = request.param
    if draft == "other":
        folder = tmp_path_factory.mktemp("spec-sampling-draft") / "other"
        overrides = {"num_hidden_layers": 1, "hidden_size": 32, "num_attention_heads": 2, "num_key_value_heads": 1}
        build_hf_model("llama", overrides, seed=11).save_pretrained(folder)
        draft = str(folder)
    spec = json.dumps({"model": draft, "num_speculative_tokens": 3})
    process = ServerProcess(
        str(served.folder), "--speculative-config", spec, "--max-num-seqs", "256", "--max-model-len", "256",
        "--num-kv-blocks", "1024",
    )  # fmt: skip
    yield process
    process.stop()


async def _paths(base_url: str, prompt: list[int]) -> list[tuple[int, ...]]:
    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=300)
    model = (await client.models.list()).data[0].id
    concurrent = asyncio.Semaphore(64)

    async def sample(seed: int) -> tuple[int, ...]:
        async with concurrent:
            response = await client.completions.create(
                model=model,
                prompt=prompt,
                max_tokens=SAMPLED_TOKENS,
                temperature=TEMPERATURE,
                seed=seed,
                logprobs=0,
                extra_body={"top_k": SAMPLED_TOP_K, "ignore_eos": True, "return_tokens_as_token_ids": True},
            )
        return tuple(int(t.removeprefix("token_id:")) for t in response.choices[0].logprobs.tokens)

    try:
        return await asyncio.gather(*(sample(seed) for seed in range(SAMPLES)))
    finally:
        await client.close()


def test_served_samples_keep_the_models_distribution(served, draft_server):
    start = prompts(5, [12], served.vocab_size)[0]
    likely = path_probabilities(served, start, TEMPERATURE)
    # Likely continuations between two copies of the start: the request's context resembles what it samples.
    prompt = start + [t for path in sorted(likely, key=likely.get)[-6:] for t in path] + start
    exact = path_probabilities(served, prompt, TEMPERATURE)
    counts = Counter(asyncio.run(_paths(draft_server.base_url, prompt)))
    assert set(counts) <= set(exact), "a continuation outside the top-k paths"
    p_value, cells = chi_square(counts, exact)
    drafted = draft_server.metric("heteroserve:spec_decode_num_draft_tokens_total")
    accepted = draft_server.metric("heteroserve:spec_decode_num_accepted_tokens_total")
    print(
        f"served draft model at T={TEMPERATURE}: chi-square p={p_value:.3f} over {cells} cells; "
        f"{accepted:.0f} of {drafted:.0f} drafts kept"
    )
    assert drafted > SAMPLES, "the requests took too few drafts to test anything"
    assert p_value > 1e-3
