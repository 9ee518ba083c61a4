"""Device platforms: detection and selection. A new device is a new file here or a plugin package."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from heteroserve.platforms.cpu.platform import CpuPlatform
from heteroserve.platforms.cuda import CudaPlatform
from heteroserve.platforms.interface import Platform
from heteroserve.platforms.mlu import MluPlatform
from heteroserve.platforms.mps import MpsPlatform
from heteroserve.platforms.npu import NpuPlatform
from heteroserve.platforms.operators import OperatorTable
from heteroserve.platforms.plugins import discover_plugins
from heteroserve.platforms.rocm import RocmPlatform
from heteroserve.platforms.xpu import XpuPlatform

logger = logging.getLogger(__name__)

# In the order `auto` tries them: accelerators first, the CPU last.
BUILTIN_PLATFORMS: dict[str, type[Platform]] = {
    "cuda": CudaPlatform,
    "rocm": RocmPlatform,
    "npu": NpuPlatform,
    "mlu": MluPlatform,
    "xpu": XpuPlatform,
    "mps": MpsPlatform,
    "cpu": CpuPlatform,
}


@dataclass
class PlatformEntry:
    name: str
    source: str  # "built-in" or "plugin <distribution>"
    cls: type[Platform] | None
    available: bool
    note: str = ""  # why it is unavailable, when known


def detect_platforms() -> list[PlatformEntry]:
    """Every platform known here, in `auto` order: plugins (installed deliberately), built-ins, the CPU.

    A plugin with a built-in's name replaces it (a vendor's own plugin knows its device best)."""
    entries: dict[str, PlatformEntry] = {}
    for plugin in discover_plugins():
        source = f"plugin {plugin.distribution}"
        if plugin.cls is None:
            note = plugin.error or "the plugin reports no device here"
            entries[plugin.name] = PlatformEntry(plugin.name, source, None, False, note)
        else:
            entries[plugin.name] = PlatformEntry(plugin.name, source, plugin.cls, _available(plugin.cls))
    for name, cls in BUILTIN_PLATFORMS.items():
        if name in entries:
            logger.info("platform plugin %s replaces the built-in %s platform", entries[name].source, name)
            continue
        available = _available(cls)
        missing = not available and cls.vendor_extension is not None and cls.vendor_version() is None
        note = f"{cls.vendor_extension} is not installed" if missing else ""
        entries[name] = PlatformEntry(name, "built-in", cls, available, note)
    cpu = entries.pop("cpu")
    return [*entries.values(), cpu]


def _available(cls: type[Platform]) -> bool:
    try:
        return cls.is_available()
    except Exception as exc:  # a half-installed vendor stack counts as absent, not as a crash
        logger.warning("%s.is_available() failed: %s", cls.__qualname__, exc)
        return False


def resolve_platform(name: str = "auto") -> Platform:
    """`auto` (or $HETEROSERVE_DEVICE) picks the first available platform in `detect_platforms` order."""
    if name == "auto":
        name = os.environ.get("HETEROSERVE_DEVICE", "auto")
    entries = detect_platforms()
    available = [e for e in entries if e.available]
    if name == "auto":
        return available[0].cls()
    entry = next((e for e in entries if e.name == name), None)
    names = ", ".join(e.name for e in available)
    if entry is None:
        raise ValueError(f"unknown device {name!r}; known: {', '.join(e.name for e in entries)}; available: {names}")
    if not entry.available:
        why = f" ({entry.note})" if entry.note else ""
        raise ValueError(f"device {name!r} is not available here{why}; available: {names}")
    return entry.cls()


__all__ = [
    "BUILTIN_PLATFORMS",
    "OperatorTable",
    "Platform",
    "PlatformEntry",
    "detect_platforms",
    "resolve_platform",
]
