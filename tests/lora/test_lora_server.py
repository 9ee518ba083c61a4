"""LoRA adapters through a real server and the official openai client: adapters picked by model name, listed with
their base as parent, loaded and unloaded at run time (API key required), refused with the problem named, and
routed by the gateway like any model. Greedy tokens against peft's merged models in transformers."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import openai
import pytest

from tests.entrypoints.server_process import ServerProcess
from tests.gateway.processes import GatewayProcess
from tests.lora.adapters import TinyAdapter, save_adapter
from tests.model.tiny_models import SPECS, as_reference, build_hf_model
from tests.reference import HFReference

BASE = "tiny-base"
KEY = "lora-secret"
NEW_TOKENS = 12


class TokenizedBase:
    def __init__(self, folder, reference: HFReference, adapters: dict[str, TinyAdapter]) -> None:
        self.folder, self.reference, self.adapters = folder, reference, adapters


@pytest.fixture(scope="module")
def tokenized_base(tmp_path_factory, default_tokenizer) -> TokenizedBase:
    """A tiny qwen2 with the default model's tokenizer (so the server detokenizes), and four adapters of it."""
    root = tmp_path_factory.mktemp("lora-server")
    model_type, overrides = SPECS["qwen2"]
    model = build_hf_model(model_type, {**overrides, "vocab_size": len(default_tokenizer)}, seed=5)
    model.save_pretrained(root / "base", safe_serialization=True)
    default_tokenizer.save_pretrained(root / "base")
    adapters = {
        "all": save_adapter(model, root / "all", "all", 1, rank=8, seed=21),
        "qv": save_adapter(model, root / "qv", "qv", 2, rank=4, targets=["q_proj", "v_proj"], seed=22),
        "late": save_adapter(model, root / "late", "late", 3, rank=8, targets=["o_proj", "down_proj"], seed=23),
        "wide": save_adapter(model, root / "wide", "wide", 4, rank=16, seed=24),  # above --max-lora-rank 8
    }
    return TokenizedBase(root / "base", as_reference(model), adapters)


@pytest.fixture(scope="module")
def lora_server(tokenized_base):
    adapters = tokenized_base.adapters
    qv = json.dumps({"name": "qv", "path": str(adapters["qv"].path), "base_model_name": BASE})
    process = ServerProcess(
        "--model", str(tokenized_base.folder), "--served-model-name", BASE, "--dtype", "float32",
        "--max-model-len", "128", "--num-kv-blocks", "64",
        "--enable-lora", "--max-loras", "1", "--max-lora-rank", "8",
        "--lora-modules", f"all={adapters['all'].path}", qv,
        "--allow-runtime-lora-updating", "--api-key", KEY,
        env={"HETEROSERVE_NUM_THREADS": "1"},
    )  # fmt: skip
    yield process
    process.stop()


def _client(server, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=key, max_retries=0)


PROMPTS = [[785, 6210, 314, 4649, 314], [19, 1009, 282, 5148, 47, 2421, 30, 216, 15, 15, 70]]


def _expected(tokenized_base: TokenizedBase, name: str, prompt: list[int]) -> list[int]:
    reference = tokenized_base.reference if name == BASE else tokenized_base.adapters[name].reference
    return reference.greedy(prompt, NEW_TOKENS).tokens


async def _greedy_tokens(base_url: str, model: str, prompt: list[int], key: str = KEY) -> list[int]:
    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key=key, max_retries=0)
    async with client:
        completion = await client.completions.create(
            model=model,
            prompt=prompt,
            max_tokens=NEW_TOKENS,
            temperature=0,
            logprobs=1,
            extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
        )
    assert completion.model == model
    return [int(token.removeprefix("token_id:")) for token in completion.choices[0].logprobs.tokens]


def test_models_list_the_adapters_with_their_parent(lora_server, tokenized_base):
    cards = {card.id: card for card in _client(lora_server).models.list().data}
    assert set(cards) == {BASE, "all", "qv"}
    assert cards["all"].parent == BASE and cards["all"].root == str(tokenized_base.adapters["all"].path)
    assert cards[BASE].parent is None
    assert _client(lora_server).models.retrieve("qv").parent == BASE


def test_requests_pick_adapters_by_model_name_in_one_batch(lora_server, tokenized_base):
    """The base model and two adapters at once through one slot (--max-loras 1): the adapters take turns."""
    jobs = [(name, prompt) for name in (BASE, "all", "qv") for prompt in PROMPTS]

    async def run_all():
        return await asyncio.gather(*(_greedy_tokens(lora_server.base_url, name, p) for name, p in jobs))

    answers = asyncio.run(run_all())
    for (name, prompt), tokens in zip(jobs, answers, strict=True):
        assert tokens == _expected(tokenized_base, name, prompt), name
    assert len({tuple(t) for t in answers}) == len(jobs), "the adapters must change the answers"
    metrics = httpx.get(f"{lora_server.base_url}/metrics").text
    info = [line for line in metrics.splitlines() if line.startswith("vllm:lora_requests_info{")]
    assert len(info) == 1 and 'max_lora="1"' in info[0] and 'running_lora_adapters=""' in info[0], info


def test_load_and_unload_at_run_time(lora_server, tokenized_base):
    late = tokenized_base.adapters["late"]
    body = {"lora_name": "late", "lora_path": str(late.path)}
    url = lora_server.base_url
    assert httpx.post(f"{url}/v1/load_lora_adapter", json=body).status_code == 401  # the API key is required
    headers = {"Authorization": f"Bearer {KEY}"}
    with pytest.raises(openai.NotFoundError, match="late"):
        _client(lora_server).completions.create(model="late", prompt=PROMPTS[0], max_tokens=2)
    loaded = httpx.post(f"{url}/v1/load_lora_adapter", json=body, headers=headers)
    assert loaded.status_code == 200 and "added successfully" in loaded.text
    again = httpx.post(f"{url}/v1/load_lora_adapter", json=body, headers=headers)
    assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]
    assert "late" in {card.id for card in _client(lora_server).models.list().data}
    tokens = asyncio.run(_greedy_tokens(url, "late", PROMPTS[1]))
    assert tokens == _expected(tokenized_base, "late", PROMPTS[1])
    unloaded = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "late"}, headers=headers)
    assert unloaded.status_code == 200
    with pytest.raises(openai.NotFoundError, match="late"):
        _client(lora_server).completions.create(model="late", prompt=PROMPTS[0], max_tokens=2)
    gone = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "late"}, headers=headers)
    assert gone.status_code == 404 and "cannot be found" in gone.json()["error"]["message"]


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"lora_name": "wide"}, "lora_path"),  # a missing field
        ({"lora_name": "x", "lora_path": "/tmp", "lora_rank": 4}, "lora_rank"),  # an unknown field
        ({"lora_name": BASE, "lora_path": "/tmp"}, "the base model's name"),
        ({"lora_name": "nowhere", "lora_path": "/nonexistent/adapter"}, "is not a folder"),
        ({"lora_name": "empty", "lora_path": ""}, "lora_path: String should have at least 1 character"),
        ({"lora_name": "long", "lora_path": "/a" * 2500}, "lora_path: String should have at most 4096 characters"),
        ({"lora_name": "long-part", "lora_path": "/" + "a" * 300}, "lora_path cannot be read: File name too long"),
        ({"lora_name": "", "lora_path": "/tmp"}, "lora_name: String should have at least 1 character"),
        ({"lora_name": "n" * 300, "lora_path": "/tmp"}, "lora_name: String should have at most 256 characters"),
    ],
)
def test_bad_loads_are_refused_naming_the_problem(lora_server, body, message):
    response = httpx.post(
        f"{lora_server.base_url}/v1/load_lora_adapter", json=body, headers={"Authorization": f"Bearer {KEY}"}
    )
    assert response.status_code == 400 and message in response.json()["error"]["message"], response.text


def test_bad_adapters_are_refused_naming_the_problem(lora_server, tokenized_base, tmp_path):
    """Rank above --max-lora-rank, an unknown target module, a missing weights file: 400s naming each."""
    good = tokenized_base.adapters["all"].path
    unknown_target = tmp_path / "unknown_target"
    missing_weights = tmp_path / "missing_weights"
    config = json.loads((good / "adapter_config.json").read_text())
    for folder in (unknown_target, missing_weights):
        folder.mkdir()
    (unknown_target / "adapter_model.safetensors").write_bytes((good / "adapter_model.safetensors").read_bytes())
    (unknown_target / "adapter_config.json").write_text(json.dumps({**config, "target_modules": ["lm_head"]}))
    (missing_weights / "adapter_config.json").write_text(json.dumps(config))
    cases = [
        (tokenized_base.adapters["wide"].path, "rank 16 is above max_lora_rank=8"),
        (unknown_target, "unknown target module 'lm_head'"),
        (missing_weights, "has no adapter_model.safetensors"),
    ]
    for i, (path, message) in enumerate(cases):
        body = {"lora_name": f"bad-{i}", "lora_path": str(path)}
        response = httpx.post(
            f"{lora_server.base_url}/v1/load_lora_adapter", json=body, headers={"Authorization": f"Bearer {KEY}"}
        )
        assert response.status_code == 400 and message in response.json()["error"]["message"], response.text
    # the server keeps serving its adapters
    assert asyncio.run(_greedy_tokens(lora_server.base_url, "qv", PROMPTS[0])) == _expected(
        tokenized_base, "qv", PROMPTS[0]
    )


def test_the_gateway_routes_an_adapter_like_any_model(lora_server, tokenized_base, tmp_path):
    config = {
        "backends": [
            {"name": "lora", "url": lora_server.base_url, "models": [BASE, "all"], "api_key": KEY},
        ],
        "routes": [{"model": "all", "aliases": ["all-alias"], "backends": ["lora"]}],
    }
    gateway = GatewayProcess(config, tmp_path)
    try:
        tokens = asyncio.run(_greedy_tokens(gateway.base_url, "all", PROMPTS[1], key="unused"))
        assert tokens == _expected(tokenized_base, "all", PROMPTS[1])
    finally:
        gateway.stop()


def test_a_module_for_another_base_model_stops_the_server(tokenized_base):
    """vLLM's base_model_name in --lora-modules is checked, not ignored: another base model's adapter is refused."""
    module = json.dumps({"name": "qv", "path": str(tokenized_base.adapters["qv"].path), "base_model_name": "other"})
    with pytest.raises(RuntimeError, match="server exited") as failed:
        ServerProcess(
            "--model", str(tokenized_base.folder), "--served-model-name", BASE, "--dtype", "float32",
            "--max-model-len", "128", "--num-kv-blocks", "64", "--enable-lora", "--lora-modules", module,
        )  # fmt: skip
    log = failed.value.args[0].rsplit("see ", 1)[1]
    assert "names base_model_name 'other', and this server serves 'tiny-base'" in Path(log).read_text()
