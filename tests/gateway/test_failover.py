"""A back end killed mid-run: the request it held before its first byte completes on another back end,
the stream it was sending ends with an SSE error event, it is marked down, and comes back when restarted."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.gateway.conftest import TINY, gateway_config
from tests.gateway.processes import GatewayProcess, StandIn

EDGE = {"X-Service-Class": "edge"}


@pytest.fixture(scope="module")
def doomed() -> StandIn:
    """A stand-in of this module's own, since the test kills it."""
    process = StandIn(TINY, "echo")
    yield process
    process.stop()


def wait_for(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.1)


def test_killed_back_end(tiny_servers, doomed, tmp_path):
    gateway = GatewayProcess(gateway_config(tiny_servers, doomed), tmp_path)
    revived: StandIn | None = None
    try:
        doomed.control(chunks=1000, delay=0.05)
        body = {"model": TINY, "prompt": [1, 2, 3], "max_tokens": 4, "ignore_eos": True}
        with (
            httpx.stream(
                "POST", f"{gateway.base_url}/v1/completions", json={**body, "stream": True}, headers=EDGE, timeout=60
            ) as stream,
            ThreadPoolExecutor(1) as pool,
        ):
            assert stream.headers["x-served-by"] == "edge"  # weight 100: the edge first
            lines = stream.iter_lines()
            assert json.loads(next(lines).removeprefix("data: "))["choices"][0]["text"] == "x"
            doomed.control(mode="stall")
            stalled = pool.submit(httpx.post, f"{gateway.base_url}/v1/completions", json=body, headers=EDGE, timeout=60)
            wait_for(lambda: len(doomed.seen()) == 2)  # the second request is held by the edge, unanswered
            doomed.stop()
            events = [line for line in lines if line]
            moved = stalled.result(timeout=60)
        assert events[-1] == "data: [DONE]"
        error = json.loads(events[-2].removeprefix("data: "))["error"]
        assert error["code"] == 502 and "broke off the stream" in error["message"]
        assert error["type"] == "InternalServerError"  # OpenAI's type for it, as the client would raise
        assert all(e.startswith("data: {") for e in events[:-1])
        assert moved.status_code == 200 and moved.headers["x-served-by"] in ("tiny-a", "tiny-b")
        assert moved.json()["usage"]["completion_tokens"] == 4

        assert gateway.states()["edge"] == "down"
        assert gateway.metric("heteroserve:gateway_backend_up", backend="edge") == 0
        assert gateway.metric("heteroserve:gateway_errors_total", backend="edge", kind="stream") == 1
        assert gateway.metric("heteroserve:gateway_errors_total", backend="edge", kind="connect") == 1
        assert gateway.metric("heteroserve:gateway_retries_total", backend="edge") == 1
        assert gateway.metric("heteroserve:gateway_in_flight", backend="edge") == 0
        after = httpx.post(f"{gateway.base_url}/v1/completions", json=body, headers=EDGE, timeout=60)
        assert after.headers["x-served-by"] in ("tiny-a", "tiny-b")

        revived = StandIn(TINY, "echo", port=doomed.port)
        wait_for(lambda: gateway.states()["edge"] == "up")
        back = httpx.post(f"{gateway.base_url}/v1/completions", json=body, headers=EDGE, timeout=60)
        assert back.headers["x-served-by"] == "edge"
    finally:
        gateway.stop()
        if revived is not None:
            revived.stop()
