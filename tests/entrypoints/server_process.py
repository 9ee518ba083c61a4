"""Starts real server processes on 127.0.0.1 for tests (`heteroserve serve` and others), and stops them."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ChildServer:
    """A process serving HTTP on 127.0.0.1:`port`, started by `command` and ready when `ready_path`
    answers 200. Its output goes to /tmp/heteroserve-test-{name}-{port}.log."""

    def __init__(
        self,
        command: list[str],
        port: int,
        name: str,
        ready_path: str = "/health/ready",
        env: dict[str, str] | None = None,
        startup_timeout: float = 180,
    ) -> None:
        self.port = port
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.ready_path = ready_path
        env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", **(env or {})}
        self.log = open(f"/tmp/heteroserve-test-{name}-{self.port}.log", "w")  # noqa: SIM115 - closed in stop()
        self.process = subprocess.Popen(command, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        self._wait_ready(startup_timeout)

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited with {self.process.returncode}; see {self.log.name}")
            try:
                if httpx.get(f"{self.base_url}{self.ready_path}", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"server not ready after {timeout} s; see {self.log.name}")

    def log_text(self) -> str:
        """What the process has written to its log so far."""
        self.log.flush()
        return Path(self.log.name).read_text()

    def metric(self, name: str, **labels: str) -> float:
        """Sum of a metric's samples in /metrics (those carrying all of `labels`)."""
        total = 0.0
        wanted = [f'{k}="{v}"' for k, v in labels.items()]
        for line in httpx.get(f"{self.base_url}/metrics").text.splitlines():
            if (line.startswith(name + "{") or line.startswith(name + " ")) and all(w in line for w in wanted):
                total += float(line.rsplit(" ", 1)[1])
        return total

    def terminate(self) -> None:
        self.process.send_signal(signal.SIGTERM)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)
        self.log.close()


class ServerProcess(ChildServer):
    """`heteroserve serve ARGS` on a free port (or `port`)."""

    def __init__(
        self, *args: str, port: int | None = None, env: dict[str, str] | None = None, startup_timeout: float = 180
    ) -> None:
        port = port or free_port()
        command = [
            sys.executable,
            "-m",
            "heteroserve.entrypoints.openai.api_server",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--uvicorn-log-level",
            "warning",
            *args,
        ]
        super().__init__(command, port, "server", env=env, startup_timeout=startup_timeout)
