"""`heteroserve serve` run as a user runs it, with the mistakes users make: each is one line on stderr naming
the problem, exit 2 and no traceback, and those found before the model loads take seconds, not minutes."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from tests.entrypoints.server_process import free_port


def serve(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """`heteroserve serve ARGS` to its end, through the real CLI entry point."""
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    command = [sys.executable, "-m", "heteroserve.entrypoints.cli", "serve", *args]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)


def assert_one_line_error(result: subprocess.CompletedProcess[str], message: str) -> None:
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    assert result.stderr.strip().splitlines()[-1] == message


def test_taken_port_is_told_before_the_model_loads():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = serve("--host", "127.0.0.1", "--port", str(port))
    assert_one_line_error(result, f"heteroserve serve: port {port} on 127.0.0.1 is in use")
    assert "weights:" not in result.stderr  # the model was never loaded


def test_out_of_range_port_is_an_argparse_error():
    result = serve("--port", "99999")
    assert_one_line_error(result, "heteroserve serve: error: argument --port: 99999 is out of range (0-65535)")


@pytest.mark.parametrize(
    ("model", "message"),
    [
        (
            "/nonexistent/checkpoint",
            "model path '/nonexistent/checkpoint' does not exist (pass a checkpoint folder, a GGUF file or owner/name)",
        ),
        (
            "nobody-here/no-such-model",
            "model 'nobody-here/no-such-model' is not in the local Hugging Face cache, and nothing is downloaded at "
            "run time: fetch it first with `hf download nobody-here/no-such-model`",
        ),
    ],
)
def test_missing_model_is_one_line_with_a_hint(model, message):
    result = serve(model, "--host", "127.0.0.1", "--port", str(free_port()), timeout=60)
    assert_one_line_error(result, f"heteroserve serve: {message}")


def test_debug_log_level_keeps_the_traceback():
    result = serve("/nonexistent/checkpoint", "--host", "127.0.0.1", "--port", str(free_port()), "--log-level", "debug")
    assert result.returncode != 0 and "Traceback" in result.stderr


def test_kv_cache_too_small_names_the_flags():
    result = serve(
        "--host", "127.0.0.1", "--port", str(free_port()), "--kv-cache-memory-bytes", "1KiB", "--max-model-len", "2048"
    )
    assert_one_line_error(
        result,
        "heteroserve serve: the KV cache holds 0 blocks of 16 tokens, fewer than one request of max_model_len=2048; "
        "raise --kv-cache-memory-bytes (kv_cache_memory_bytes) or lower --max-model-len (max_model_len)",
    )


def test_bad_kv_cache_size_is_an_argparse_error_naming_the_flag():
    result = serve("--kv-cache-memory-bytes", "4XB")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "argument --kv-cache-memory-bytes: invalid byte_size value: '4XB'" in result.stderr


@pytest.mark.parametrize(
    ("host", "api_key", "warned"), [("0.0.0.0", None, True), ("0.0.0.0", "k", False), ("127.0.0.1", None, False)]
)
def test_listening_beyond_loopback_without_a_key_is_warned(host, api_key, warned):
    key = ["--api-key", api_key] if api_key else []
    result = serve("/nonexistent/checkpoint", "--host", host, "--port", str(free_port()), *key, timeout=60)
    assert result.returncode == 2
    assert ("without --api-key" in result.stderr) == warned, result.stderr
