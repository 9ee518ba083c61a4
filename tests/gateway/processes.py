"""The gateway and the stand-in back end as test processes."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import httpx
import yaml

from tests.entrypoints.server_process import ChildServer, free_port


class StandIn(ChildServer):
    """tests/gateway/stand_in.py on `port` (a free one by default; pass the old one to restart it)."""

    def __init__(self, *models: str, port: int | None = None) -> None:
        port = port or free_port()
        command = [sys.executable, "-m", "tests.gateway.stand_in", "--port", str(port)]
        for model in models:
            command += ["--model", model]
        super().__init__(command, port, "stand-in", ready_path="/health", startup_timeout=60)

    def control(self, **settings) -> None:
        httpx.post(f"{self.base_url}/control", json=settings).raise_for_status()

    def seen(self) -> list[dict]:
        return httpx.get(f"{self.base_url}/seen").json()


class GatewayProcess(ChildServer):
    """`heteroserve gateway ARGS` on a free port with `config` written to `folder`/gateway.yaml."""

    def __init__(self, config: dict, folder: Path, *args: str) -> None:
        self.config_path = folder / "gateway.yaml"
        self.write(config)
        port = free_port()
        command = [sys.executable, "-m", "heteroserve.entrypoints.cli", "gateway", "--config", str(self.config_path)]
        command += ["--host", "127.0.0.1", "--port", str(port), "--uvicorn-log-level", "warning", *args]
        super().__init__(command, port, "gateway", ready_path="/health", startup_timeout=60)

    def write(self, config: dict) -> None:
        self.config_path.write_text(yaml.safe_dump(config))

    def reload(self, config: dict) -> None:
        self.write(config)
        self.process.send_signal(signal.SIGHUP)

    def states(self) -> dict[str, str]:
        return httpx.get(f"{self.base_url}/health").json()["backends"]
