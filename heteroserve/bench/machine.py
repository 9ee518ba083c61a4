"""A description of the machine a benchmark ran on, for results files."""

from __future__ import annotations

import os
import platform

from heteroserve.platforms import Platform
from heteroserve.platforms.cpu.platform import process_threads


def describe_machine(device_platform: Platform) -> dict[str, object]:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    try:
        memory_gib = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1024**3, 1)
    except (ValueError, OSError):
        memory_gib = None
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "threads": process_threads(),
        "memory_gib": memory_gib,
        "python": platform.python_version(),
        "os": platform.platform(),
        **device_platform.describe(),
    }
