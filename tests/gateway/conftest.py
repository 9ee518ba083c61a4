"""Back ends for the gateway tests: two heteroserve servers on a tiny model (token-id prompts only), the
session server on the default model (chat), and the stand-in. Each test module starts its own gateway,
so a test that reloads or kills something leaves the others alone."""

from __future__ import annotations

import pytest

from tests.entrypoints.server_process import ServerProcess
from tests.gateway.processes import GatewayProcess, StandIn
from tests.model.tiny_models import save_tiny

TINY = "tiny"
SMOL = "SmolLM2-135M-Instruct"
HEALTH = {"interval": 0.3, "timeout": 1.0, "failure_threshold": 2, "cooldown": 0.5}


@pytest.fixture(scope="session")
def tiny_servers(tmp_path_factory) -> list[ServerProcess]:
    folder = save_tiny("llama_tied", tmp_path_factory.mktemp("gateway")).folder
    flags = ["--served-model-name", TINY, "--max-model-len", "128", "--dtype", "float32"]
    flags += ["--kv-cache-memory-bytes", str(8 * 1024**2), "--model", str(folder)]
    servers = [ServerProcess(*flags, env={"HETEROSERVE_NUM_THREADS": "1"}) for _ in range(2)]
    yield servers
    for server in servers:
        server.stop()


@pytest.fixture(scope="session")
def stand_in() -> StandIn:
    process = StandIn(TINY, "echo")
    yield process
    process.stop()


def gateway_config(tiny_servers: list[ServerProcess], stand_in: StandIn, smol_url: str | None = None) -> dict:
    """tiny goes to the two tiny servers by default and to the stand-in ("edge", weight 100, with the two
    tiny servers behind it) in service class "edge"; echo only to the stand-in; SmolLM2 (alias smol) to
    the session server."""
    a, b = tiny_servers
    backends = [
        {"name": "tiny-a", "url": a.base_url, "models": [TINY], "labels": {"pool": "cpu"}},
        {"name": "tiny-b", "url": b.base_url, "models": [TINY], "labels": {"pool": "cpu"}},
        {
            "name": "edge",
            "url": stand_in.base_url,
            "models": [TINY, "echo"],
            "labels": {"pool": "edge"},
            "weight": 100,
            "api_key": "edge-secret",
        },
    ]
    routes = [
        {"model": TINY, "aliases": ["tiny-alias"], "selector": {"pool": "cpu"}},
        {"model": TINY, "service_class": "edge", "selector": {"pool": "edge"}, "backends": ["tiny-a", "tiny-b"]},
    ]
    if smol_url:
        backends.append({"name": "smol", "url": smol_url, "models": [SMOL], "labels": {"pool": "big"}})
        routes.append({"model": SMOL, "aliases": ["smol"], "backends": ["smol"]})
    return {"backends": backends, "routes": routes, "health": HEALTH, "max_attempts": 3}


@pytest.fixture(scope="module")
def gateway(tiny_servers, stand_in, server, tmp_path_factory) -> GatewayProcess:
    process = GatewayProcess(gateway_config(tiny_servers, stand_in, server.base_url), tmp_path_factory.mktemp("gw"))
    yield process
    process.stop()
