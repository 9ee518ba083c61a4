"""Starts a real `heteroserve serve` process on 127.0.0.1 for tests, and stops it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, *args: str, startup_timeout: float = 180) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
        command = [
            sys.executable,
            "-m",
            "heteroserve.entrypoints.openai.api_server",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--uvicorn-log-level",
            "warning",
            *args,
        ]
        self.log = open(f"/tmp/heteroserve-test-server-{self.port}.log", "w")  # noqa: SIM115 - closed in stop()
        self.process = subprocess.Popen(command, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        self._wait_ready(startup_timeout)

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited with {self.process.returncode}; see {self.log.name}")
            try:
                if httpx.get(f"{self.base_url}/health/ready", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise TimeoutError(f"server not ready after {timeout} s; see {self.log.name}")

    def metric(self, name: str) -> float:
        """Sum of a metric's samples in /metrics."""
        total = 0.0
        for line in httpx.get(f"{self.base_url}/metrics").text.splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                total += float(line.rsplit(" ", 1)[1])
        return total

    def terminate(self) -> None:
        self.process.send_signal(signal.SIGTERM)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)
        self.log.close()
