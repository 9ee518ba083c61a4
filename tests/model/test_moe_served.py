"""Each mixture-of-experts family through a real server with the official openai client, with everything that
moves a request's tokens between steps switched on: prefix caching (the requests share a prefix), chunked prefill
(a 16-token budget), preemption (too few KV blocks for the requests at once) and n-gram speculation (the prompts
repeat themselves, so drafts are proposed). Greedy tokens and their logprobs against transformers."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from tests.entrypoints.server_process import ServerProcess
from tests.model.tiny_models import TinyModel, check_served_choice, prompts, save_tiny

MOE_FAMILIES = [
    "mixtral",
    "qwen2_moe",
    "qwen3_moe",
    "ernie4_5_moe",
    "glm4_moe",
    "deepseek_v2",
    "deepseek_v3",
    "gpt_oss",
]
NEW_TOKENS = 12
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Iterator[dict[str, tuple[TinyModel, ServerProcess]]]:
    root = tmp_path_factory.mktemp("moe-served")
    tinies = {name: save_tiny(name, root) for name in MOE_FAMILIES}

    def start(name: str) -> ServerProcess:
        return ServerProcess(
            str(tinies[name].folder),
            *("--max-model-len", "64", "--block-size", "8", "--num-kv-blocks", "14", "--dtype", "float32"),
            *("--max-num-batched-tokens", "16", "--served-model-name", name),
            *("--speculative-config", json.dumps(NGRAM)),
        )

    with ThreadPoolExecutor(2) as pool:
        servers = dict(zip(tinies, pool.map(start, tinies), strict=True))
    try:
        yield {name: (tinies[name], servers[name]) for name in tinies}
    finally:
        for server in servers.values():
            server.stop()


def _counter(metrics: str, name: str) -> float:
    return sum(float(v) for v in re.findall(rf"^vllm:{name}(?:_total)?(?:{{[^}}]*}})? (\S+)$", metrics, re.M))


@pytest.mark.parametrize("name", MOE_FAMILIES)
def test_moe_family_through_the_server(name, served, greedy_comparison):
    tiny, server = served[name]
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused")
    shared = prompts(21, [16], tiny.vocab_size)[0]
    tails = [t * 3 for t in prompts(22, [5, 6, 7, 4], tiny.vocab_size)]  # repeats give the n-gram drafter matches
    token_prompts = [shared + tail for tail in tails]

    def complete(batch: list[list[int]]):
        return client.completions.create(
            model=name,
            prompt=batch,
            max_tokens=NEW_TOKENS,
            temperature=0,
            logprobs=1,
            extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
        )

    complete(token_prompts[:1])  # fills the prefix cache with the shared blocks
    choices = sorted(complete(token_prompts).choices, key=lambda c: c.index)  # one request: scheduled together
    for i, (prompt, choice) in enumerate(zip(token_prompts, choices, strict=True)):
        check_served_choice(f"{name} served[{i}]", choice, prompt, tiny, NEW_TOKENS, greedy_comparison)
    metrics = httpx.get(f"{server.base_url}/metrics").text
    assert _counter(metrics, "num_preemptions") > 0
    assert _counter(metrics, "gpu_prefix_cache_hits") >= 16
    assert _counter(metrics, "spec_decode_num_draft_tokens") > 0
