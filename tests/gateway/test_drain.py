"""SIGTERM drains the gateway as it does a server: readiness turns 503, new requests get OpenAI's 503, the
stream in flight is relayed to its end (or, past --drain-timeout, ends with an error event), then the gateway
exits 0. Each test has a gateway of its own, since it ends it."""

from __future__ import annotations

import json
import time

import httpx

from tests.gateway.conftest import HEALTH, SMOL
from tests.gateway.processes import GatewayProcess


def test_sigterm_drains_then_exits_zero(server, tmp_path):
    config = {"backends": [{"name": "smol", "url": server.base_url, "models": [SMOL]}], "health": HEALTH}
    gateway = GatewayProcess(config, tmp_path)
    url = gateway.base_url
    try:
        body = {"model": SMOL, "prompt": "Write a poem", "max_tokens": 24, "ignore_eos": True, "stream": True}
        body["stream_options"] = {"include_usage": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as stream:
            lines = stream.iter_lines()
            events = [next(lines)]  # the stream is under way
            gateway.terminate()
            deadline = time.monotonic() + 10
            while (ready := httpx.get(f"{url}/health/ready")).status_code != 503:
                assert time.monotonic() < deadline, "readiness never turned 503"
                time.sleep(0.02)
            assert ready.json()["status"] == "draining"
            refused = httpx.post(f"{url}/v1/completions", json={**body, "stream": False}, timeout=10)
            assert refused.status_code == 503
            assert refused.json()["error"] == {
                "message": "the gateway is shutting down",
                "type": "ServiceUnavailableError",
                "param": None,
                "code": 503,
            }
            events += [line for line in lines if line]
        assert events[-1] == "data: [DONE]"
        assert json.loads(events[-2].removeprefix("data: "))["usage"]["completion_tokens"] == 24
        assert gateway.process.wait(30) == 0
    finally:
        gateway.stop()


def test_streams_past_the_drain_timeout_end_with_an_error_event(stand_in, tmp_path):
    """A stream that outlasts --drain-timeout ends with OpenAI's error event and [DONE] when the timeout passes
    (it was cut with no event: the client got an incomplete chunked read), then the gateway exits 0."""
    stand_in.control(chunks=1000, delay=0.05)  # a 50 s stream
    config = {"backends": [{"name": "edge", "url": stand_in.base_url, "models": ["echo"]}], "health": HEALTH}
    gateway = GatewayProcess(config, tmp_path, "--drain-timeout", "1")
    try:
        body = {"model": "echo", "prompt": "hi", "stream": True}
        with httpx.stream("POST", f"{gateway.base_url}/v1/completions", json=body, timeout=60) as stream:
            lines = stream.iter_lines()
            events = [next(lines)]  # the stream is under way
            gateway.terminate()
            started = time.monotonic()
            events += [line for line in lines if line]
        assert 1 <= time.monotonic() - started < 5
        assert len(events) > 5  # it was relayed during the drain
        assert events[-1] == "data: [DONE]"
        error = json.loads(events[-2].removeprefix("data: "))["error"]
        assert error["code"] == 503 and error["type"] == "ServiceUnavailableError"
        assert "drain timeout" in error["message"]
        assert gateway.process.wait(30) == 0
    finally:
        gateway.stop()
        stand_in.control(chunks=5, delay=0.0)
