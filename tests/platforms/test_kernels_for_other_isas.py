"""The C++ kernels' AVX2 and generic (NEON-shaped) code paths, built as the prebuilt levels the container image
carries and tested on this machine (slow set: ~40 s of compiling per level)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from heteroserve.platforms.cpu import cpu_isa_flags

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.parametrize("level,panel", [("x86_64_v3", 16), ("x86_64", 8)])
def test_kernels_built_for_another_isa_pass_the_kernel_tests(level, panel):
    if "avx2" not in cpu_isa_flags():
        pytest.skip("needs an x86-64 CPU with AVX2 to run the builds")
    run = subprocess.run(
        [sys.executable, "tests/platforms/kernels_for_isa.py", level], cwd=ROOT, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert f"GEMM panels {panel} wide" in run.stdout
