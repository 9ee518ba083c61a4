"""Careless clients against the session server: one that hangs up before its first byte, one whose n > 1
request is refused part-way. Either way nothing of theirs keeps running or holds KV blocks."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx

from tests.entrypoints.server_process import ServerProcess

LONG = 400  # tokens a dropped request would generate if nothing stopped it: ~10 s here


def wait_until_idle(server: ServerProcess, timeout: float) -> dict[str, float]:
    """Polls the engine gauges until nothing runs, waits or holds a KV block; returns the last reading."""
    deadline = time.monotonic() + timeout
    while True:
        gauges = {
            name: server.metric(f"heteroserve:{name}")
            for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")
        }
        if not any(gauges.values()) or time.monotonic() > deadline:
            return gauges
        time.sleep(0.1)


def send_and_hang_up(server: ServerProcess, body: dict, after: float) -> None:
    """Sends a whole completion request on a raw connection and closes it `after` seconds later, before any
    byte of the answer can arrive (the engine is busy, so the request is still queued)."""
    payload = json.dumps(body).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\n\r\n"
    ).encode()
    with socket.create_connection(("127.0.0.1", server.port)) as connection:
        connection.sendall(head + payload)
        time.sleep(after)


def test_clients_gone_before_their_first_byte_leave_nothing_running(server):
    """Hang-ups land while the engine thread has yet to accept the request (mid-step) as well as after: every
    one is aborted, so once the load is done the engine is idle at once, not ~10 s later."""
    load = {"prompt": "Tell me a long story about a dragon", "max_tokens": 48, "ignore_eos": True}
    loaders = [
        threading.Thread(
            target=httpx.post, args=(f"{server.base_url}/v1/completions",), kwargs={"json": load, "timeout": 120}
        )
        for _ in range(4)
    ]
    for loader in loaders:
        loader.start()
    deadline = time.monotonic() + 30
    while server.metric("heteroserve:num_requests_running") < 4 and time.monotonic() < deadline:
        time.sleep(0.05)
    dropped = {"prompt": "Write an essay about the sea", "max_tokens": LONG, "ignore_eos": True}
    droppers = [threading.Thread(target=send_and_hang_up, args=(server, dropped, 0.01 * (i + 1))) for i in range(12)]
    for dropper in droppers:
        dropper.start()
    for thread in droppers + loaders:
        thread.join()
    gauges = wait_until_idle(server, timeout=2)
    assert not any(gauges.values()), gauges


def test_refused_n_request_leaves_no_sample_running(server):
    """Sample 1 would use seed + 1 = 2**63, past 64 bits: the 400 comes before sample 0 is queued, not after."""
    body = {"prompt": "hi", "seed": 2**63 - 1, "n": 2, "max_tokens": 200, "ignore_eos": True}
    response = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "BadRequestError"
    assert error["message"].startswith("n=2: sample 1 (which uses seed + 1) is invalid: seed must be a 64-bit")
    gauges = wait_until_idle(server, timeout=1)
    assert not any(gauges.values()), gauges
