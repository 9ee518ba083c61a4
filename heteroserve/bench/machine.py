"""A description of the machine a benchmark ran on, for results files, and the threads its peers run on."""

from __future__ import annotations

import contextlib
import os
import platform
from collections.abc import Iterator

import torch

from heteroserve.platforms import Platform
from heteroserve.platforms.cpu import process_threads


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


@contextlib.contextmanager
def torch_at_full_threads() -> Iterator[None]:
    """torch's OpenMP team at the process's thread count while an in-process peer (transformers,
    sentence-transformers) runs: our engine, in the same process, gives torch one thread once its own pool owns
    the cores (CpuPlatform.assign_threads), and gets that back afterwards."""
    previous = torch.get_num_threads()
    torch.set_num_threads(process_threads())
    try:
        yield
    finally:
        torch.set_num_threads(previous)
