"""Each family through a real server with the official openai client: greedy tokens and their logprobs against
transformers on the family's tiny random model (tests/model/tiny_models.py; the remote-code layouts written by
tests/model/remote_code_checkpoints.py). The families' every trait is checked in depth in test_architectures.py;
this is the path a user takes (`heteroserve serve FOLDER`)."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from tests.entrypoints.server_process import ServerProcess
from tests.model.test_architectures import REMOTE_CODE
from tests.model.tiny_models import TinyModel, as_reference, build_hf_model, check_served_choice, prompts, save_tiny

# The families beyond Llama, Mistral and Qwen2/3 (whose server paths the rest of the suite covers).
FAMILIES = ["gemma", "gemma2", "gemma3", "phi3", "glm", "glm4", "ernie4_5", "smollm3", "granite", "olmo2"]
NEW_TOKENS = 8


def _tiny(name: str, root) -> TinyModel:
    if name in FAMILIES:
        return save_tiny(name, root)
    model_type, overrides, write = REMOTE_CODE[name]
    model = build_hf_model(model_type, overrides, seed=40)
    write(model, root / name)
    return TinyModel(name, root / name, as_reference(model))


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Iterator[dict[str, tuple[TinyModel, ServerProcess]]]:
    """Every family's server, started two at a time (a start is mostly single-threaded imports)."""
    root = tmp_path_factory.mktemp("served")
    tinies = {name: _tiny(name, root) for name in FAMILIES + list(REMOTE_CODE)}

    def start(name: str) -> ServerProcess:
        args = ("--max-model-len", "128", "--num-kv-blocks", "64", "--dtype", "float32", "--served-model-name", name)
        return ServerProcess(str(tinies[name].folder), *args)

    with ThreadPoolExecutor(2) as pool:
        servers = dict(zip(tinies, pool.map(start, tinies), strict=True))
    try:
        yield {name: (tinies[name], servers[name]) for name in tinies}
    finally:
        for server in servers.values():
            server.stop()


@pytest.mark.parametrize("name", FAMILIES + list(REMOTE_CODE))
def test_family_through_the_server(name, served, greedy_comparison):
    tiny, server = served[name]
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused")
    prompt = prompts(11, [30], tiny.vocab_size)[0]
    response = client.completions.create(
        model=name,
        prompt=prompt,
        max_tokens=NEW_TOKENS,
        temperature=0,
        logprobs=1,
        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
    )
    check_served_choice(f"{name} served", response.choices[0], prompt, tiny, NEW_TOKENS, greedy_comparison)
