"""The gateway in front of real back ends: routing, balancing, request ids, retries and the breaker, the
openai client, API keys, and the config reload on SIGHUP."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from pathlib import Path

import httpx
import openai
import pytest

from tests.gateway.conftest import SMOL, TINY, gateway_config
from tests.gateway.processes import GatewayProcess

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def complete(gateway: GatewayProcess, model: str = TINY, headers: dict | None = None, **body) -> httpx.Response:
    body = {"model": model, "prompt": [1, 2, 3], "max_tokens": 3, "temperature": 0, **body}
    return httpx.post(f"{gateway.base_url}/v1/completions", json=body, headers=headers, timeout=60)


def wait_for(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.1)


def test_models_and_probes(gateway):
    ids = [m["id"] for m in httpx.get(f"{gateway.base_url}/v1/models").json()["data"]]
    assert ids == sorted([TINY, "tiny-alias", "echo", SMOL, "smol"])
    assert httpx.get(f"{gateway.base_url}/health/ready").json()["status"] == "ready"
    assert gateway.states() == {"tiny-a": "up", "tiny-b": "up", "edge": "up", "smol": "up"}
    assert "<title>heteroserve chat</title>" in httpx.get(gateway.base_url).text


def test_routing_by_model_alias_and_class(gateway):
    default = complete(gateway)
    assert default.status_code == 200 and default.headers["x-served-by"] in ("tiny-a", "tiny-b")
    assert default.json()["usage"]["completion_tokens"] == 3
    alias = complete(gateway, "tiny-alias")
    assert alias.headers["x-served-by"] in ("tiny-a", "tiny-b") and alias.json()["model"] == TINY
    edge = complete(gateway, headers={"X-Service-Class": "edge"})
    assert edge.headers["x-served-by"] == "edge" and edge.json()["choices"][0]["text"].startswith("stand-in")
    assert complete(gateway, "echo").headers["x-served-by"] == "edge"
    unknown_class = complete(gateway, headers={"X-Service-Class": "gold"})
    assert unknown_class.headers["x-served-by"] in ("tiny-a", "tiny-b")
    missing = complete(gateway, "nope")
    assert missing.status_code == 404
    assert missing.json()["error"] == {
        "message": "the model 'nope' does not exist",
        "type": "NotFoundError",
        "param": "model",
        "code": 404,
    }
    bad = httpx.post(f"{gateway.base_url}/v1/completions", content=b"{", headers={"X-Request-Id": "r-1"})
    assert bad.status_code == 400 and bad.headers["x-request-id"] == "r-1"


def test_request_id_and_backend_key_are_forwarded(gateway, stand_in):
    given = complete(gateway, headers={"X-Service-Class": "edge", "X-Request-Id": "req-42"})
    assert given.headers["x-request-id"] == "req-42"
    assert stand_in.seen()[-1] == {"request_id": "req-42", "auth": "Bearer edge-secret"}
    generated = complete(gateway, headers={"X-Service-Class": "edge", "Authorization": "Bearer client-key"})
    assert len(generated.headers["x-request-id"]) == 32
    assert stand_in.seen()[-1] == {"request_id": generated.headers["x-request-id"], "auth": "Bearer edge-secret"}


def test_balancing_spreads_over_equal_back_ends(gateway):
    before = {name: gateway.metric("heteroserve:gateway_requests_total", backend=name) for name in ("tiny-a", "tiny-b")}

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=gateway.base_url, timeout=60) as client:
            body = {"model": TINY, "prompt": [5, 6, 7], "max_tokens": 24, "ignore_eos": True}
            return await asyncio.gather(*(client.post("/v1/completions", json=body) for _ in range(12)))

    responses = asyncio.run(burst())
    assert all(r.status_code == 200 for r in responses)
    spread = Counter(r.headers["x-served-by"] for r in responses)
    assert set(spread) == {"tiny-a", "tiny-b"} and min(spread.values()) >= 3, spread
    for name in ("tiny-a", "tiny-b"):
        sent = gateway.metric("heteroserve:gateway_requests_total", backend=name) - before[name]
        assert sent == spread[name]
        assert gateway.metric("heteroserve:gateway_in_flight", backend=name) == 0


def test_client_leaving_mid_stream_frees_the_back_end(gateway, stand_in):
    stand_in.control(chunks=1000, delay=0.05)
    try:
        body = {"model": "echo", "prompt": "hi", "stream": True}
        with httpx.stream("POST", f"{gateway.base_url}/v1/completions", json=body, timeout=60) as stream:
            lines = stream.iter_lines()  # kept: a dropped iterator closes the response
            assert next(lines).startswith("data: {")
            assert gateway.metric("heteroserve:gateway_in_flight", backend="edge") == 1
        wait_for(lambda: gateway.metric("heteroserve:gateway_in_flight", backend="edge") == 0)
        assert gateway.states()["edge"] == "up"
    finally:
        stand_in.control(chunks=5, delay=0.0)


def test_openai_client_through_the_gateway(gateway):
    client = openai.OpenAI(base_url=f"{gateway.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
    full = client.completions.create(
        model=TINY, prompt=[1, 2, 3], max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
    )
    chunks = list(
        client.completions.create(
            model=TINY, prompt=[1, 2, 3], max_tokens=6, temperature=0, stream=True, extra_body={"ignore_eos": True}
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert full.usage.completion_tokens == 6
    reply = client.chat.completions.create(model="smol", messages=QUESTION, temperature=0, max_tokens=30)
    assert reply.choices[0].message.content == "The capital of France is Paris."
    stream = client.chat.completions.create(model=SMOL, messages=QUESTION, temperature=0, max_tokens=30, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == "The capital of France is Paris."
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=QUESTION)


def test_5xx_is_retried_and_opens_the_breaker(gateway, stand_in):
    retries = gateway.metric("heteroserve:gateway_retries_total", backend="edge")
    stand_in.control(mode="error")
    try:
        moved = complete(gateway, headers={"X-Service-Class": "edge"})
        assert moved.status_code == 200 and moved.headers["x-served-by"] in ("tiny-a", "tiny-b")
        assert gateway.metric("heteroserve:gateway_retries_total", backend="edge") == retries + 1
        only_edge = complete(gateway, "echo")  # nowhere else to go: the back end's answer comes back
        assert only_edge.status_code == 500 and only_edge.json()["error"]["message"] == "stand-in told to fail"
        assert gateway.states()["edge"] == "down"  # failure_threshold is 2
        assert gateway.metric("heteroserve:gateway_backend_up", backend="edge") == 0
        no_backend = complete(gateway, "echo")
        assert no_backend.status_code == 503 and "no healthy back end" in no_backend.json()["error"]["message"]
    finally:
        stand_in.control(mode="ok")
    wait_for(lambda: gateway.states()["edge"] == "up")  # the health check brings it back after the cooldown
    stand_in.control(mode="unhealthy")
    try:
        wait_for(lambda: gateway.states()["edge"] == "down")
        assert httpx.get(f"{gateway.base_url}/health/ready").status_code == 200
    finally:
        stand_in.control(mode="ok")
    wait_for(lambda: gateway.states()["edge"] == "up")
    assert complete(gateway, "echo").status_code == 200


def test_429_reaches_the_client_with_retry_after(gateway, stand_in):
    """A back end's 429 comes back with its Retry-After, or the gateway's (1 s) when it sent none, so that clients
    know when to retry (it came without one)."""
    stand_in.control(mode="busy", retry_after="7")
    try:
        relayed = complete(gateway, "echo")
        assert relayed.status_code == 429 and relayed.headers["retry-after"] == "7"
        assert relayed.json()["error"]["type"] == "RateLimitError"
        stand_in.control(retry_after=None)
        added = complete(gateway, "echo")
        assert added.status_code == 429 and added.headers["retry-after"] == "1"
    finally:
        stand_in.control(mode="ok", retry_after=None)


def test_api_keys(tiny_servers, stand_in, tmp_path):
    config = gateway_config(tiny_servers, stand_in)
    config["api_keys"] = [{"key": "k1"}, {"key": "k2", "service_class": "edge"}]
    gateway = GatewayProcess(config, tmp_path)
    try:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "k1"}):
            refused = complete(gateway, headers=headers)
            assert refused.status_code == 401
            assert refused.json()["error"]["type"] == "AuthenticationError"
            assert "x-request-id" in refused.headers
        assert httpx.get(f"{gateway.base_url}/v1/models").status_code == 401
        assert complete(gateway, headers={"Authorization": "Bearer k1"}).headers["x-served-by"] != "edge"
        assert complete(gateway, headers={"Authorization": "Bearer k2"}).headers["x-served-by"] == "edge"
        for open_path in ("/", "/health", "/health/ready", "/metrics"):
            assert httpx.get(gateway.base_url + open_path).status_code == 200
        client = openai.OpenAI(base_url=f"{gateway.base_url}/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            client.models.list()
    finally:
        gateway.stop()


def test_sighup_reload_keeps_in_flight_streams(tiny_servers, stand_in, tmp_path):
    config = gateway_config(tiny_servers, stand_in)
    gateway = GatewayProcess(config, tmp_path)
    stand_in.control(chunks=20, delay=0.1)
    try:
        body = {"model": "echo", "prompt": "hi", "max_tokens": 20, "stream": True}
        with httpx.stream("POST", f"{gateway.base_url}/v1/completions", json=body, timeout=60) as stream:
            lines = stream.iter_lines()
            assert next(lines).startswith("data: {")
            config["routes"][0]["aliases"] = ["tiny-renamed"]
            config["backends"][2]["models"] = [TINY]  # echo goes away
            gateway.reload(config)
            wait_for(lambda: "tiny-renamed" in httpx.get(f"{gateway.base_url}/v1/models").text)
            events = [line for line in lines if line]
        assert len(events) == 20 and events[-1] == "data: [DONE]"
        assert complete(gateway, "echo").status_code == 404
        assert complete(gateway, "tiny-alias").status_code == 404
        assert complete(gateway, "tiny-renamed").status_code == 200
        gateway.config_path.write_text("backends: []")  # a bad file is refused; the running config stays
        gateway.process.send_signal(1)
        time.sleep(1)
        assert gateway.process.poll() is None and complete(gateway, "tiny-renamed").status_code == 200
        assert "reload refused" in Path(gateway.log.name).read_text()
    finally:
        stand_in.control(chunks=5, delay=0.0)
        gateway.stop()
