"""The CPU platform reports this architecture's extensions only (scripts/test-aarch64.sh runs this on arm64)."""

from __future__ import annotations

import platform

from heteroserve.platforms.cpu.platform import ISA_NAMES, cpu_isa_flags, is_arm64, isa_names

ARM64_FLAGS = {"asimd", "asimdhp", "asimddp", "sve", "sve2", "bf16"}


def _cpuinfo_words(key: str) -> set[str]:
    with open("/proc/cpuinfo") as f:
        for line in f:
            name, _, value = line.partition(":")
            if name.strip() == key:
                return set(value.split())
    return set()


def test_flags_belong_to_this_architecture():
    flags = cpu_isa_flags()
    assert flags <= set(ISA_NAMES)
    if is_arm64():
        assert "asimd" in flags, "every arm64 Linux CPU has Advanced SIMD (NEON)"
        assert flags <= ARM64_FLAGS, f"x86 flags reported on arm64: {flags - ARM64_FLAGS}"
        assert "NEON" in isa_names(flags)
    else:
        assert platform.machine() in ("x86_64", "AMD64")
        assert not flags & ARM64_FLAGS
        expected = _cpuinfo_words("flags") & (set(ISA_NAMES) - ARM64_FLAGS)
        assert flags == expected
