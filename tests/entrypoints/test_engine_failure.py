"""When the model step raises, every waiting client gets a 500 with a message, and /health turns 503.

The failure is injected into a real engine (a tiny model) by making its model runner raise, which is
what a device error mid-step looks like to the engine loop; the app runs in-process over ASGI.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

from heteroserve.engine.async_engine import AsyncLLMEngine
from heteroserve.entrypoints.openai.api_server import build_app
from heteroserve.entrypoints.openai.serving import ServerSettings
from tests.model.tiny_models import save_tiny


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny("llama_tied", tmp_path_factory.mktemp("failure"))


def test_engine_failure_answers_500_and_turns_unhealthy(tiny):
    engine = AsyncLLMEngine(tiny.llm(max_model_len=64, num_kv_blocks=16).engine)
    app = build_app(engine, ServerSettings(["tiny"]))

    async def scenario():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=60) as client:
            ok = await client.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 3})
            assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
            assert (await client.get("/health")).status_code == 200

            def broken(*_args, **_kwargs):
                raise RuntimeError("device lost")

            engine.engine.runner.execute = broken
            first, second = await asyncio.gather(
                client.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 5}),
                client.post("/v1/completions", json={"prompt": [4, 5], "max_tokens": 5, "stream": True}),
            )
            for response in (first, second):
                assert response.status_code == 500
                assert "device lost" in response.json()["error"]["message"]
            assert (await client.get("/health")).status_code == 503
            assert (await client.get("/health/ready")).status_code == 503
            after = await client.post("/v1/completions", json={"prompt": [1], "max_tokens": 1})
            assert after.status_code == 500

    asyncio.run(scenario())
    engine.shutdown()
