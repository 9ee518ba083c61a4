"""Every x86-64 level this machine can run, in CI: the C++ kernels built for the level
($HETEROSERVE_CPU_LEVEL: x86_64_v3 is AVX2 + FMA + F16C, x86_64 the SSE2 baseline whose generic vector code is
the shape NEON gets) with torch's own dispatch held to the same level ($ATEN_CPU_CAPABILITY), then the kernel
tests and the default model's greedy tokens (4-bit as shipped and float32) against this process's native build.
A level's library is the one `heteroserve build-kernels --prebuilt` made for the session (conftest.py), the build
a container image carries.
The most capable level the CPU runs is what the native build (-march=native) already is, so it is not built
again. aarch64 runs under qemu-user: scripts/test-aarch64.sh."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from heteroserve.platforms.cpu.kernel_variants import LEVEL_VARIABLE, supported_variants, variants_for
from heteroserve.platforms.cpu.kernels import cpu_flags

ROOT = Path(__file__).resolve().parents[2]
KERNEL_TESTS = [
    "tests/platforms/test_cpu_packed_linear.py",
    "tests/platforms/test_cpu_kernels.py",
    "tests/platforms/test_cpu_kernels_bfloat16.py",
    "tests/platforms/test_cpu_decode_layer.py",
    "tests/platforms/test_cpu_lora_products.py",
    "tests/quantization/test_int4.py",
    "tests/quantization/test_int8.py",
]
TORCH_CAPABILITY = {"x86_64_v4": "avx512", "x86_64_v3": "avx2", "x86_64": "default"}
# Greedy tokens may part only where the native run's top two logprobs are this close (a near-tie).
NEAR_TIE = 1e-3
SUPPORTED = [v.name for v in supported_variants(set(cpu_flags().split()))]


def _level_env(level: str | None, prebuilt: Path | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in (LEVEL_VARIABLE, "ATEN_CPU_CAPABILITY")}
    if level is not None:
        env[LEVEL_VARIABLE] = level
        env["ATEN_CPU_CAPABILITY"] = TORCH_CAPABILITY[level]
        env["HETEROSERVE_PREBUILT_KERNELS"] = str(prebuilt)
    return env


def _tokens(level: str | None, prebuilt: Path | None = None) -> dict:
    run = subprocess.run(
        [sys.executable, "tests/platforms/level_tokens.py"],
        cwd=ROOT,
        env=_level_env(level, prebuilt),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def native_tokens() -> dict:
    return _tokens(None)


@pytest.mark.parametrize("level", [v.name for v in variants_for() if v.name != "armv8_a"] or ["none"])
def test_a_level_passes_the_kernel_tests_and_gives_the_native_tokens(level, request):
    if level not in SUPPORTED:
        pytest.skip(f"this CPU cannot run {level}")
    if level == SUPPORTED[0]:
        pytest.skip(f"{level} is this CPU's most capable level: the native build the suite runs")
    native_tokens = request.getfixturevalue("native_tokens")
    prebuilt = request.getfixturevalue("prebuilt_kernels")[0]
    tests = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *KERNEL_TESTS],
        cwd=ROOT,
        env=_level_env(level, prebuilt),
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert tests.returncode == 0, tests.stdout[-4000:] + tests.stderr[-2000:]
    ours = _tokens(level, prebuilt)
    assert ours["build"] == f"{level} ({LEVEL_VARIABLE}, prebuilt)"
    assert ours["torch_cpu_capability"] == TORCH_CAPABILITY[level].upper()
    near_ties = 0
    for form in ("int4", "float32"):
        for i, (theirs, mine) in enumerate(zip(native_tokens[form], ours[form], strict=True)):
            for step, (a, b) in enumerate(zip(theirs["tokens"], mine["tokens"], strict=True)):
                if a != b:
                    margin = theirs["margins"][step]
                    assert margin < NEAR_TIE, f"{form} prompt {i} parts at step {step} (top-2 margin {margin:.4f})"
                    near_ties += 1
                    break
    margins = [m for form in ("int4", "float32") for run in native_tokens[form] for m in run["margins"]]
    smallest = min(margins)
    print(f"{level}: tokens equal to native's, {near_ties} near-tie divergences, smallest top-2 margin {smallest:.4f}")
