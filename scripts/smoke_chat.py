"""Smoke test of a deployment: /health, /health/ready, /metrics and one chat request through the openai client.

Against a running server or gateway (`--base-url`, e.g. a container), or, with `--serve`, a `heteroserve serve`
it starts on 127.0.0.1 and then stops with SIGTERM (which must drain and exit 0). Exits non-zero on any failure.
Used by scripts/test-aarch64.sh and tests/deploy/test_container_image.py.
"""

from __future__ import annotations

import argparse
import signal
import socket
import subprocess
import sys
import time

import httpx
from openai import OpenAI

QUESTION = "What is the capital of France?"


def wait_ready(base_url: str, timeout: float, process: subprocess.Popen | None = None) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if process is not None and process.poll() is not None:
            sys.exit(f"server exited with {process.returncode} before it was ready")
        try:
            if httpx.get(f"{base_url}/health/ready", timeout=5).status_code == 200:
                return time.monotonic() - start
        except httpx.HTTPError:
            pass
        time.sleep(1)
    sys.exit(f"{base_url}/health/ready did not answer 200 within {timeout} s")


def check(base_url: str, expect: str) -> None:
    assert httpx.get(f"{base_url}/health", timeout=10).status_code == 200, "/health is not 200"
    metrics = httpx.get(f"{base_url}/metrics", timeout=10).text
    assert "\nheteroserve:" in metrics, "/metrics has no heteroserve:* series"
    client = OpenAI(base_url=f"{base_url}/v1", api_key="unused", timeout=1800)
    model = client.models.list().data[0].id
    start = time.monotonic()
    reply = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": QUESTION}], max_tokens=30, temperature=0
    )
    answer = reply.choices[0].message.content
    print(
        f"model {model}: {QUESTION!r} -> {answer!r} ({reply.usage.completion_tokens} tokens, "
        f"{time.monotonic() - start:.1f} s)"
    )
    assert expect in answer, f"the answer does not contain {expect!r}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--serve", action="store_true", help="start `heteroserve serve` on a free port first")
    parser.add_argument("--ready-timeout", type=float, default=300)
    parser.add_argument("--expect", default="Paris", help="text the answer must contain")
    args, serve_args = parser.parse_known_args()
    process = None
    base_url = args.base_url
    if args.serve:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        base_url = f"http://127.0.0.1:{port}"
        command = [sys.executable, "-m", "heteroserve.entrypoints.openai.api_server", "--host", "127.0.0.1"]
        process = subprocess.Popen([*command, "--port", str(port), *serve_args])
    try:
        print(f"ready after {wait_ready(base_url, args.ready_timeout, process):.0f} s")
        check(base_url, args.expect)
    finally:
        if process is not None and process.poll() is None:
            process.send_signal(signal.SIGTERM)
            code = process.wait(120)
            print(f"server exited with {code} after SIGTERM")
            if code != 0:
                sys.exit(f"server exited with {code} after SIGTERM, not 0")
    print("smoke test passed")


if __name__ == "__main__":
    main()
