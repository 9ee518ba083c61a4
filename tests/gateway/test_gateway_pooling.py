"""The gateway in front of an embedding back end and a generating one: /v1/embeddings (OpenAI's client),
/v1/rerank, /rerank, /v1/score and /score reach the back end serving the body's model and answer as it does."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.conftest import EMBEDDER
from tests.gateway.conftest import HEALTH, SMOL
from tests.gateway.processes import GatewayProcess

TEXTS = ["The river in the morning.", "A quiet garden.", "Music on a summer evening, by the window."]


@pytest.fixture(scope="module")
def gateway(embedding_server, server, tmp_path_factory) -> GatewayProcess:
    config = {
        "backends": [
            {"name": "embed", "url": embedding_server.base_url, "models": [EMBEDDER]},
            {"name": "smol", "url": server.base_url, "models": [SMOL]},
        ],
        "routes": [{"model": EMBEDDER, "aliases": ["embedder-alias"], "backends": ["embed"]}],
        "health": HEALTH,
    }
    process = GatewayProcess(config, tmp_path_factory.mktemp("gw-pooling"))
    yield process
    process.stop()


def post(base_url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{base_url}{path}", json=body, timeout=120)


def test_embeddings_through_the_gateway_equal_the_back_ends(gateway, embedding_server):
    client = openai.OpenAI(base_url=f"{gateway.base_url}/v1", api_key="unused", max_retries=0)
    through = client.embeddings.create(model="embedder-alias", input=TEXTS)  # base64, decoded by the client
    direct = openai.OpenAI(base_url=f"{embedding_server.base_url}/v1", api_key="unused", max_retries=0)
    expected = direct.embeddings.create(model=EMBEDDER, input=TEXTS, encoding_format="float")
    assert [d.embedding for d in through.data] == [d.embedding for d in expected.data]
    assert through.model == EMBEDDER and through.usage == expected.usage


@pytest.mark.parametrize("path", ["/v1/rerank", "/rerank"])
def test_rerank_through_the_gateway(gateway, embedding_server, path):
    body = {"model": EMBEDDER, "query": TEXTS[0], "documents": TEXTS[1:]}
    through = post(gateway.base_url, path, body)
    assert through.status_code == 200 and through.headers["x-served-by"] == "embed"
    assert through.json()["results"] == post(embedding_server.base_url, path, body).json()["results"]


@pytest.mark.parametrize("path", ["/v1/score", "/score"])
def test_score_through_the_gateway(gateway, embedding_server, path):
    body = {"model": EMBEDDER, "text_1": TEXTS[0], "text_2": TEXTS[1:]}
    through = post(gateway.base_url, path, body)
    assert through.status_code == 200 and through.headers["x-served-by"] == "embed"
    assert through.json()["data"] == post(embedding_server.base_url, path, body).json()["data"]


def test_wrong_task_and_unknown_model_answer_as_the_back_end_does(gateway):
    refused = post(gateway.base_url, "/score", {"model": SMOL, "text_1": "a", "text_2": "b"})
    assert refused.status_code == 400 and refused.headers["x-served-by"] == "smol"
    assert "(task generate)" in refused.json()["error"]["message"]
    chat = {"model": EMBEDDER, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    refused = post(gateway.base_url, "/v1/chat/completions", chat)
    assert refused.status_code == 400 and "(task embed)" in refused.json()["error"]["message"]
    missing = post(gateway.base_url, "/rerank", {"model": "nope", "query": "a", "documents": ["b"]})
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "model"
    assert post(gateway.base_url, "/score", {"text_1": "a", "text_2": "b"}).status_code == 400  # no model


def test_gateway_model_cards_carry_the_back_ends_task_and_capabilities(gateway):
    """The chat page offers images only to a model with vision, and clients see what each model is for."""
    cards = {card["id"]: card for card in httpx.get(f"{gateway.base_url}/v1/models").json()["data"]}
    assert cards[EMBEDDER]["task"] == "embed" and cards[SMOL]["task"] == "generate"
    assert cards[SMOL]["capabilities"] == {"vision": False}
    assert cards[SMOL]["max_model_len"] > 0
