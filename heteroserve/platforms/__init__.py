"""Device platforms: detection and selection. A new device is a new file here or a plugin package."""

from __future__ import annotations

import os

from heteroserve.platforms.cpu import CpuPlatform
from heteroserve.platforms.cuda import CudaPlatform
from heteroserve.platforms.interface import Platform

BUILTIN_PLATFORMS: dict[str, type[Platform]] = {"cuda": CudaPlatform, "cpu": CpuPlatform}


def resolve_platform(name: str = "auto") -> Platform:
    """`auto` (or $HETEROSERVE_DEVICE) picks the first available accelerator, else the CPU."""
    if name == "auto":
        name = os.environ.get("HETEROSERVE_DEVICE", "auto")
    available = {key: cls for key, cls in BUILTIN_PLATFORMS.items() if cls.is_available()}
    if name == "auto":
        return next(iter(available.values()))()
    if name not in BUILTIN_PLATFORMS:
        raise ValueError(f"unknown device {name!r}; known: {', '.join(BUILTIN_PLATFORMS)}")
    if name not in available:
        raise ValueError(f"device {name!r} is not available here; available: {', '.join(available)}")
    return available[name]()


__all__ = ["Platform", "resolve_platform", "BUILTIN_PLATFORMS"]
