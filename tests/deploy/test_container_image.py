"""A real amd64 image build and a smoke run: /health, /health/ready, /metrics, one chat request through the
openai client, HEALTHCHECK turning healthy, a non-root user, a read-only root file system (as the Kubernetes
manifests run it) with the C++ kernels prebuilt into the image loaded, and SIGTERM (docker stop) draining to
exit code 0.

Slow and opt-in: python -m pytest -m slow tests/deploy/test_container_image.py (root, a Docker engine; the
build takes minutes the first time). HETEROSERVE_IMAGE=NAME tests an image built already;
HETEROSERVE_IMAGE_ARCH=arm64 builds and runs the arm64 image under qemu (docs/AARCH64.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.entrypoints.server_process import free_port

pytestmark = pytest.mark.slow
ROOT = Path(__file__).parents[2]
ARCH = os.environ.get("HETEROSERVE_IMAGE_ARCH", "amd64")


def docker(*args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(["docker", *args], capture_output=True, text=True, check=check, timeout=timeout)


@pytest.fixture(scope="module")
def image() -> str:
    try:
        info = docker("info", "--format", "{{.ServerVersion}}", check=False, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        pytest.skip(f"no container engine: {exc}")
    if info.returncode != 0:
        pytest.skip(
            f"no container engine could be reached (docker info: {info.stderr.strip()[:200]}); start one: "
            "apt-get install docker.io && dockerd & (docs/DEPLOYMENT.md)"
        )
    name = os.environ.get("HETEROSERVE_IMAGE")
    if name is None:
        subprocess.run(["bash", str(ROOT / "scripts" / "build-image.sh"), ARCH], check=True, timeout=3600)
        name = f"heteroserve:0.1.0-{ARCH}"
    return name


def test_image_serves_the_default_model(image):
    port = free_port()
    run = ["run", "-d", "--platform", f"linux/{ARCH}", "-p", f"127.0.0.1:{port}:8000", "--read-only", "--tmpfs", "/tmp"]
    if ARCH == "arm64":  # the Kunpeng 920 stand-in, as scripts/test-aarch64.sh: qemu's default CPU has SVE, whose
        run += ["-e", "QEMU_CPU=neoverse-n1"]  # emulation left the chat unanswered after 600 s
    run += ["--health-interval", "2s", "--health-start-period", "300s", image]
    container = docker(*run).stdout.strip()
    try:
        smoke = [sys.executable, str(ROOT / "scripts" / "smoke_chat.py"), "--base-url", f"http://127.0.0.1:{port}"]
        result = subprocess.run(smoke, capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, result.stdout + result.stderr + docker("logs", container).stderr[-3000:]
        assert "The capital of France is Paris." in result.stdout
        assert docker("exec", container, "id", "-u").stdout.strip() == "10001"
        assert docker("exec", container, "uname", "-m").stdout.strip() == {"amd64": "x86_64", "arm64": "aarch64"}[ARCH]
        # No compiler in the image and a read-only root: the C++ kernels are the ones built into the image.
        env = json.loads(docker("exec", container, "heteroserve", "env", "--json", timeout=300).stdout)
        assert env["chosen"]["cpp_kernels"].startswith("prebuilt "), env["chosen"]
        assert env["chosen"]["operators"]["linear"] == "cpp packed gemm"
        deadline = time.monotonic() + 60
        while json.loads(docker("inspect", "--format", "{{json .State.Health.Status}}", container).stdout) != "healthy":
            assert time.monotonic() < deadline, "HEALTHCHECK never turned healthy"
            time.sleep(1)
        docker("stop", "--time", "40", container, timeout=60)
        state = json.loads(docker("inspect", "--format", "{{json .State}}", container).stdout)
        assert state["ExitCode"] == 0, docker("logs", container).stderr[-3000:]
    finally:
        docker("rm", "-f", container, check=False)
