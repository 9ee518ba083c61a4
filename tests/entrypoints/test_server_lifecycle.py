"""API keys, load shedding and SIGTERM drain, on a server of their own (it is shut down at the end)."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import openai
import pytest

from tests.entrypoints.server_process import ServerProcess

KEY = "sk-test-key"
ORIGIN = "http://chat.example.test"


@pytest.fixture(scope="module")
def strict_server():
    process = ServerProcess(
        "--max-model-len",
        "256",
        "--kv-cache-memory-bytes",
        str(32 * 1024**2),
        "--api-key",
        KEY,
        "--served-model-name",
        "smol",
        "smol-alias",
        "--max-waiting-requests",
        "2",
        "--max-num-seqs",
        "1",
        "--drain-timeout",
        "60",
        "--allowed-origins",
        ORIGIN,
    )
    yield process
    process.stop()


def test_api_key_guards_only_the_api(strict_server):
    url = strict_server.base_url
    assert httpx.get(f"{url}/v1/models").status_code == 401
    wrong = httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401 and wrong.json()["error"]["type"] == "AuthenticationError"
    assert httpx.post(f"{url}/tokenize", json={"prompt": "hi"}).status_code == 401
    for open_path in ("/health", "/health/ready", "/metrics", "/version"):
        assert httpx.get(f"{url}{open_path}").status_code == 200, open_path
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
    assert [m.id for m in client.models.list().data] == ["smol", "smol-alias"]
    reply = client.completions.create(model="smol-alias", prompt="Hi", max_tokens=2)
    assert reply.model == "smol" and reply.choices[0].text is not None
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0).models.list()


def test_ready_log_names_the_page_url_and_a_keyed_loopback_server_is_not_warned(strict_server):
    log = strict_server.log_text()
    assert f"chat page and API at http://127.0.0.1:{strict_server.port}/" in log
    assert "without --api-key" not in log


def test_cors_preflight_needs_no_key(strict_server):
    """Browsers send no Authorization header on a preflight: CORS must answer it before the key check."""
    headers = {
        "Origin": ORIGIN,
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type",
    }
    preflight = httpx.options(f"{strict_server.base_url}/v1/chat/completions", headers=headers)
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == ORIGIN
    keyed = httpx.get(
        f"{strict_server.base_url}/v1/models", headers={"Origin": ORIGIN, "Authorization": f"Bearer {KEY}"}
    )
    assert keyed.status_code == 200 and keyed.headers["access-control-allow-origin"] == ORIGIN


def test_waiting_queue_limit_holds_against_a_burst(strict_server):
    """One sequence runs at a time and two may wait. Twelve requests sent at once (completions and chats share
    the count) arrive before the engine thread has queued any of them: two, or three if the first has started
    running meanwhile, are admitted and finish; the rest get OpenAI's 429 at once, with a Retry-After."""
    headers = {"Authorization": f"Bearer {KEY}"}
    completion = {"model": "smol", "prompt": "Tell me a story", "max_tokens": 24, "ignore_eos": True}
    chat = {"model": "smol", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 24, "ignore_eos": True}

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=strict_server.base_url, headers=headers, timeout=300) as client:
            sends = [
                client.post("/v1/completions", json=completion)
                if i % 2
                else client.post("/v1/chat/completions", json=chat)
                for i in range(12)
            ]
            return await asyncio.gather(*sends)

    responses = asyncio.run(burst())
    statuses = [r.status_code for r in responses]
    assert set(statuses) == {200, 429} and statuses.count(429) >= 9, statuses
    refused = [r for r in responses if r.status_code == 429]
    assert {r.headers.get("retry-after") for r in refused} == {"1"}  # when clients may try again, in seconds
    assert refused[0].json() == {
        "error": {
            "message": "too many requests waiting (limit 2); retry later",
            "type": "RateLimitError",
            "param": None,
            "code": 429,
        }
    }
    for gauge in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        assert strict_server.metric(f"heteroserve:{gauge}") == 0, gauge


def _start_until(server: ServerProcess, workers: list[threading.Thread], gauge: str, count: int) -> None:
    """Starts the workers' requests and waits (up to a minute) until the server's gauge reads `count`."""
    for worker in workers:
        worker.start()
    deadline = time.monotonic() + 60
    while server.metric(gauge) < count and time.monotonic() < deadline:
        time.sleep(0.05)


def test_sigterm_drains_then_exits_zero(strict_server):
    """A JSON request and a stream (queued behind it: one sequence runs at a time) both finish after SIGTERM."""
    url = strict_server.base_url
    result: dict[str, object] = {}
    headers = {"Authorization": f"Bearer {KEY}"}

    def long_request() -> None:
        body = {"model": "smol", "prompt": "Write a poem", "max_tokens": 60, "ignore_eos": True}
        response = httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=300)
        result["status"] = response.status_code
        result["tokens"] = response.json()["usage"]["completion_tokens"]

    def long_stream() -> None:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=300)
        chunks = client.completions.create(
            model="smol",
            prompt="Write a song",
            max_tokens=40,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        result["stream_tokens"] = [c.usage.completion_tokens for c in chunks if c.usage][-1]

    workers = [threading.Thread(target=long_request), threading.Thread(target=long_stream)]
    _start_until(strict_server, workers, "heteroserve:num_requests_waiting", 1)
    strict_server.terminate()
    time.sleep(0.3)
    assert httpx.get(f"{url}/health/ready").status_code == 503
    refused = httpx.post(
        f"{url}/v1/completions", json={"model": "smol", "prompt": "late"}, headers={"Authorization": f"Bearer {KEY}"}
    )
    assert refused.status_code == 503
    for worker in workers:
        worker.join(120)
    assert result == {"status": 200, "tokens": 60, "stream_tokens": 40}
    assert strict_server.process.wait(60) == 0


def test_requests_past_the_drain_timeout_end_with_an_error_not_a_cut_connection():
    """SIGTERM with --drain-timeout 1 while a stream and a JSON request run longer: the stream ends with an error
    event and [DONE], the JSON request gets a 503 naming the drain, and the server exits 0."""
    process = ServerProcess("--max-model-len", "512", "--kv-cache-memory-bytes", str(32 * 1024**2),
                            "--drain-timeout", "1")  # fmt: skip
    url = f"{process.base_url}/v1/completions"
    body = {"prompt": "Write a long story", "max_tokens": 480, "ignore_eos": True, "temperature": 0}
    result: dict[str, object] = {}

    def stream() -> None:
        with httpx.stream("POST", url, json={**body, "stream": True}, timeout=120) as response:
            result["events"] = [line.removeprefix("data: ") for line in response.iter_lines() if line.strip()]

    def whole() -> None:
        response = httpx.post(url, json=body, timeout=120)
        result["whole"] = (response.status_code, response.json())

    try:
        workers = [threading.Thread(target=stream), threading.Thread(target=whole)]
        _start_until(process, workers, "heteroserve:num_requests_running", 2)
        process.terminate()
        for worker in workers:
            worker.join(60)
        events = result["events"]
        assert events[-1] == "[DONE]" and "drain timeout" in json.loads(events[-2])["error"]["message"]
        assert len(events) > 3  # some tokens came before the cut
        status, answer = result["whole"]
        assert status == 503 and "drain timeout" in answer["error"]["message"]
        assert process.process.wait(60) == 0
    finally:
        process.stop()
