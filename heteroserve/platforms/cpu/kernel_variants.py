"""Prebuilt builds of the CPU platform's C++ kernels, for machines that cannot build their own.

A container image has no compiler and a read-only root, so the library cannot be built where it runs; without
it every operator falls back to torch's reference, which is much slower (bench/README.md, `--kernels reference`).
`heteroserve build-kernels --prebuilt` compiles the library once per instruction-set level of the machine's
architecture (the x86-64 psABI levels, as distributions and llama.cpp's CPU variants do) into
$HETEROSERVE_PREBUILT_KERNELS, or share/heteroserve/cpu-kernels under the Python environment, which the image
carries; at run time the most capable level this CPU supports is loaded. A level's build differs from a
`-march=native` one only in tuning: the kernels use the vector width (AVX-512, AVX2, SSE/NEON).
"""

from __future__ import annotations

import os
import platform as pyplatform
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class KernelVariant:
    name: str  # also the library's name: an identifier
    march: str
    needs: frozenset[str]  # /proc/cpuinfo flags the level's code may use


_X86_64_V3 = frozenset({"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"})
_X86_64_V4 = _X86_64_V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
# Most capable first, per architecture (platform.machine()).
VARIANTS: dict[str, tuple[KernelVariant, ...]] = {
    "x86_64": (
        KernelVariant("x86_64_v4", "x86-64-v4", _X86_64_V4),
        KernelVariant("x86_64_v3", "x86-64-v3", _X86_64_V3),
        KernelVariant("x86_64", "x86-64", frozenset()),
    ),
    # NEON is part of Armv8-A: one build serves Kunpeng 920, Phytium and Graviton alike.
    "aarch64": (KernelVariant("armv8_a", "armv8-a", frozenset()),),
}


def variants_for(machine: str | None = None) -> tuple[KernelVariant, ...]:
    machine = (machine or pyplatform.machine()).lower()
    return VARIANTS.get({"amd64": "x86_64", "arm64": "aarch64"}.get(machine, machine), ())


def supported_variants(cpu_flags: set[str], machine: str | None = None) -> list[KernelVariant]:
    """The levels whose instructions this CPU has, the most capable first."""
    return [v for v in variants_for(machine) if v.needs <= cpu_flags]


LEVEL_VARIABLE = "HETEROSERVE_CPU_LEVEL"


def forced_variant(name: str, cpu_flags: set[str], machine: str | None = None) -> KernelVariant:
    """The level $HETEROSERVE_CPU_LEVEL names; a ValueError naming the choices where this CPU cannot run it."""
    known = {v.name: v for v in variants_for(machine)}
    if name not in known:
        raise ValueError(f"{LEVEL_VARIABLE}={name} is not a level of this architecture (levels: {', '.join(known)})")
    variant = known[name]
    missing = variant.needs - cpu_flags
    if missing:
        raise ValueError(f"{LEVEL_VARIABLE}={name}: this CPU lacks {', '.join(sorted(missing))}")
    return variant


def prebuilt_root() -> Path:
    return Path(os.environ.get("HETEROSERVE_PREBUILT_KERNELS") or Path(sys.prefix) / "share/heteroserve/cpu-kernels")


def variant_cflags(variant: KernelVariant, native_cflags: list[str]) -> list[str]:
    return [f"-march={variant.march}" if flag == "-march=native" else flag for flag in native_cflags]


def compiler_available() -> bool:
    """torch's extension builder runs $CXX, else c++."""
    return shutil.which(os.environ.get("CXX") or "c++") is not None
