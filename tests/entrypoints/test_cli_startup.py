"""The `heteroserve` command's light paths load neither torch nor transformers (issues #40 item 7, #42 item 3).

Each path runs in a fresh interpreter, which then reports which of the two it imported; the gateway also runs as
its own process, whose memory must map no torch library. Wall times and the gateway's RSS are printed (pytest -s),
not asserted: on a shared machine a timing threshold fails for reasons of its own.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.gateway.processes import GatewayProcess, StandIn

HEAVY = ("torch", "transformers")

# Runs `heteroserve ARGV` as the console script does (the exit of --help caught), then prints on its last line
# which of HEAVY it imported. `patch` runs first.
PROBE = """
import json, sys
{patch}
from heteroserve.entrypoints.cli import main
try:
    main(sys.argv[1:])
except SystemExit:
    pass
print(json.dumps([name for name in {heavy!r} if name in sys.modules]))
"""

# The gateway's server, instead of listening, starts the app (health checks included) and relays one chat request
# through it, so that the probe sees what a serving gateway imports.
ONE_REQUEST = """
from starlette.testclient import TestClient
from heteroserve.entrypoints.openai.draining_server import DrainingServer

def answer_once(self, sockets=None):
    with TestClient(self.config.app) as client:
        body = {"model": "echo", "messages": [{"role": "user", "content": "hi"}]}
        print(client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"])

DrainingServer.run = answer_once
"""


def run_probe(*argv: str, patch: str = "") -> tuple[list[str], str, float]:
    """Which of HEAVY `heteroserve ARGV` imported, what it printed, and the process's wall time in seconds."""
    start = time.perf_counter()
    result = subprocess.run(
        [sys.executable, "-c", PROBE.format(patch=patch, heavy=HEAVY), *argv],
        capture_output=True,
        text=True,
        timeout=120,
    )
    elapsed = time.perf_counter() - start
    assert result.returncode == 0, result.stderr
    *output, last = result.stdout.splitlines()
    return json.loads(last), "\n".join(output), elapsed


@pytest.fixture(scope="module")
def stand_in() -> StandIn:
    process = StandIn("echo")
    yield process
    process.stop()


def gateway_config(stand_in: StandIn) -> dict:
    return {"backends": [{"name": "stand-in", "url": stand_in.base_url, "models": ["echo"]}]}


@pytest.mark.parametrize(
    "argv",
    [["--help"], ["chat", "--help"], ["gateway", "--help"], ["serve", "--help"], ["bench", "--help"]],
    ids=" ".join,
)
def test_help_imports_no_torch(argv):
    heavy, output, elapsed = run_probe(*argv)
    print(f"heteroserve {' '.join(argv)}: {elapsed:.2f} s wall")
    assert output.startswith("usage: heteroserve")
    assert heavy == []


def test_subcommands_declare_their_flags_without_their_implementation():
    _, serve, _ = run_probe("serve", "--help")
    assert "--tool-call-parser" in serve and "--max-model-len" in serve and "--metrics-prefix" in serve
    _, export, _ = run_probe("export", "onnx", "--help")
    assert "--kv-layout {paged,contiguous}" in export and "--vision-grid" in export
    _, throughput, _ = run_probe("bench", "throughput", "--help")
    assert "also run a peer: hf, llama-cpp, vllm" in throughput and "--enable-prefix-caching" in throughput


def test_import_heteroserve_loads_the_engine_on_first_use():
    code = (
        "import json, sys\n"
        "from heteroserve import SamplingParams\n"
        f"light = [name for name in {HEAVY!r} if name in sys.modules]\n"
        "from heteroserve import LLM\n"
        "from heteroserve.entrypoints.llm import LLM as EngineLLM\n"
        "print(json.dumps([light, LLM is EngineLLM, 'torch' in sys.modules]))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == [[], True, True]


def test_chat_with_a_server_imports_no_torch(stand_in):
    heavy, output, elapsed = run_probe("chat", "--url", stand_in.base_url, "--no-color", "--prompt", "hi")
    print(f"heteroserve chat --url ... --prompt hi: {elapsed:.2f} s wall")
    assert "xxxxx" in output  # the stand-in's five streamed chunks
    assert heavy == []


def test_gateway_serving_a_request_imports_no_torch(stand_in, tmp_path):
    config = tmp_path / "gateway.yaml"
    config.write_text(json.dumps(gateway_config(stand_in)))  # YAML reads JSON
    heavy, output, _ = run_probe("gateway", "--config", str(config), patch=ONE_REQUEST)
    assert output.startswith("stand-in stand-in")  # the back end's answer, relayed
    assert heavy == []


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads a process's memory maps in /proc")
def test_gateway_process_maps_no_torch(stand_in, tmp_path):
    gateway = GatewayProcess(gateway_config(stand_in), tmp_path)
    try:
        maps = Path(f"/proc/{gateway.process.pid}/maps").read_text()
        status = Path(f"/proc/{gateway.process.pid}/status").read_text()
    finally:
        gateway.stop()
    rss = next(line.split(":", 1)[1].strip() for line in status.splitlines() if line.startswith("VmRSS:"))
    print(f"heteroserve gateway RSS: {rss}")
    assert "libtorch" not in maps
