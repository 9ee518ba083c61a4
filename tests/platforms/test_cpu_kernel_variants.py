"""Prebuilt kernel levels (cpu/kernel_variants.py): `heteroserve build-kernels --prebuilt` really builds them, and
a process with no compiler and no build of its own (the container image) loads the most capable level its CPU
runs, with results equal to torch's; with none there it warns and keeps the reference operators."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from heteroserve.platforms.cpu.kernel_variants import supported_variants, variants_for
from heteroserve.platforms.cpu.kernels import cpu_flags, prebuilt_directory

ROOT = Path(__file__).resolve().parents[2]
AVX2 = {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"}
AVX512 = AVX2 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}

# Runs in a process that has no compiler (CXX names none) and an empty cache of its own builds.
PROBE = """
import json, torch
from heteroserve.platforms.cpu import kernels as cpu_kernels
from heteroserve.platforms.cpu.platform import CpuPlatform
loaded = cpu_kernels.load_library()
result = {"loaded": loaded, "build": cpu_kernels.loaded_build(), "describe": CpuPlatform().describe()["cpp_kernels"]}
if loaded:
    x, w, b = torch.randn(37, 200), torch.randn(300, 200), torch.randn(300)
    packed = torch.ops.heteroserve.pack_linear_weight(w)
    got = torch.ops.heteroserve.packed_linear(x, packed, 300, b)
    result["max_error"] = (got - torch.nn.functional.linear(x, w, b)).abs().max().item()
print(json.dumps(result))
"""


def names(flags: set[str], machine: str) -> list[str]:
    return [v.name for v in supported_variants(flags, machine)]


def test_levels_follow_the_cpu_flags():
    assert names(AVX512, "x86_64") == ["x86_64_v4", "x86_64_v3", "x86_64"]
    assert names(AVX2 | {"avx512f"}, "x86_64") == ["x86_64_v3", "x86_64"]  # AVX-512 F alone is not level 4
    assert names(AVX2 - {"fma"}, "AMD64") == ["x86_64"]
    assert names(set(), "aarch64") == names({"asimd", "asimddp"}, "arm64") == ["armv8_a"]
    assert names(AVX512, "riscv64") == []


def probe(tmp_path: Path, prebuilt: Path) -> tuple[dict, str]:
    env = {
        **os.environ,
        "CXX": str(tmp_path / "no-compiler"),
        "TORCH_EXTENSIONS_DIR": str(tmp_path / "own-builds"),
        "HETEROSERVE_PREBUILT_KERNELS": str(prebuilt),
        "OMP_NUM_THREADS": "1",
    }
    run = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1]), run.stderr


def test_build_kernels_prebuilt_builds_every_level_and_keeps_only_libraries(prebuilt_kernels):
    root, printed = prebuilt_kernels
    assert len(list(root.iterdir())) == len(variants_for())
    for variant in variants_for():
        directory = prebuilt_directory(variant, root)
        assert [p.name for p in directory.iterdir()] == [f"{directory.name}.so"]
        assert f"{variant.name}: {directory / directory.name}.so" in printed


def test_without_a_compiler_the_best_prebuilt_level_for_this_cpu_is_loaded(prebuilt_kernels, tmp_path):
    best = supported_variants(set(cpu_flags().split()))[0]
    result, _ = probe(tmp_path, prebuilt_kernels[0])
    assert result["loaded"] and result["build"] == result["describe"] == f"prebuilt {best.name}"
    assert result["max_error"] < 1e-4


def test_a_lower_level_is_loaded_when_the_best_is_missing(prebuilt_kernels, tmp_path):
    supported = supported_variants(set(cpu_flags().split()))
    if len(supported) < 2:
        pytest.skip("this CPU runs one level only")
    partial = tmp_path / "partial"
    partial.mkdir()
    directory = prebuilt_directory(supported[-1], prebuilt_kernels[0])
    (partial / directory.name).symlink_to(directory)
    result, _ = probe(tmp_path, partial)
    assert result["build"] == f"prebuilt {supported[-1].name}" and result["max_error"] < 1e-4


def test_without_a_compiler_or_prebuilt_build_the_reference_remains(tmp_path):
    result, stderr = probe(tmp_path, tmp_path / "nothing-here")
    assert result == {"loaded": False, "build": "none", "describe": "none"}
    assert "no C++ compiler" in stderr and "no prebuilt" in stderr and "reference operators" in stderr
