"""The `sim` device: the C++ backend built and loaded, PrivateUse1 renamed, `torch.sim` registered.

This is what a vendor's torch extension (torch_npu, torch_mlu) does when it is imported: after `load()`,
`torch.device("sim")`, `tensor.to("sim")`, `tensor.is_sim` and `torch.sim.mem_get_info()` work, and mixing a
`sim` tensor with a CPU tensor in one operator raises as it would on an NPU.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import threading
from pathlib import Path
from types import SimpleNamespace

import torch

BACKEND = "sim"
SOURCE = Path(__file__).parent / "csrc" / "simulated_device.cpp"
# The device's memory as `mem_get_info` reports it: the KV cache is sized from it, so it stays small by default.
DEFAULT_MEMORY_BYTES = 2 * 1024**3

_lock = threading.Lock()
_library: ctypes.CDLL | None = None


def build_directory() -> Path:
    """One folder per source and torch version, so a library found there is the one these sources make."""
    key = hashlib.sha256(SOURCE.read_bytes() + torch.__version__.encode()).hexdigest()[:16]
    root = Path(os.environ.get("HETEROSERVE_SIMULATED_DEVICE_BUILD", Path.home() / ".cache" / "heteroserve"))
    return root / f"simulated_device_{key}"


def load() -> None:
    """Builds the backend once (about a minute on two cores), loads it and registers the device with torch."""
    global _library
    with _lock:
        if _library is not None:
            return
        directory = build_directory()
        library = directory / f"{directory.name}.so"
        if library.exists():
            torch.ops.load_library(str(library))
        else:
            from torch.utils.cpp_extension import load as build

            directory.mkdir(parents=True, exist_ok=True)
            build(
                name=directory.name,
                sources=[str(SOURCE)],
                extra_cflags=["-O2"],
                build_directory=str(directory),
                is_python_module=False,
            )
        _library = ctypes.CDLL(str(library))
        for name in ("heteroserve_simulated_allocated_bytes", "heteroserve_simulated_peak_bytes"):
            getattr(_library, name).restype = ctypes.c_int64
        _library.heteroserve_simulated_register_hooks()
        torch.utils.rename_privateuse1_backend(BACKEND)
        torch._register_device_module(BACKEND, _device_module())
        torch.utils.generate_methods_for_privateuse1_backend(for_tensor=True, for_module=True, for_storage=True)


def memory_allocated(device: object = None) -> int:
    """Bytes the device's allocator holds now (every device index together)."""
    assert _library is not None
    return _library.heteroserve_simulated_allocated_bytes()


def max_memory_allocated(device: object = None) -> int:
    assert _library is not None
    return _library.heteroserve_simulated_peak_bytes()


def total_memory() -> int:
    return int(os.environ.get("HETEROSERVE_SIMULATED_MEMORY_BYTES", DEFAULT_MEMORY_BYTES))


def mem_get_info(device: object = None) -> tuple[int, int]:
    """(free, total) of the simulated memory, as `torch.cuda.mem_get_info` answers for a GPU."""
    total = total_memory()
    return max(total - memory_allocated(), 0), total


def _device_module() -> SimpleNamespace:
    """`torch.sim`: what heteroserve's platform interface and torch's own helpers call on a device module."""
    assert _library is not None
    library = _library

    def set_device(device: int | torch.device) -> None:
        library.heteroserve_simulated_set_device(device.index if isinstance(device, torch.device) else int(device))

    def manual_seed_all(seed: int) -> None:
        library.heteroserve_simulated_manual_seed_all(ctypes.c_uint64(seed & 0xFFFF_FFFF_FFFF_FFFF))

    return SimpleNamespace(
        is_available=lambda: True,
        is_initialized=lambda: True,
        _is_in_bad_fork=lambda: False,
        device_count=library.heteroserve_simulated_device_count,
        current_device=library.heteroserve_simulated_current_device,
        set_device=set_device,
        synchronize=lambda device=None: None,
        empty_cache=lambda: None,
        mem_get_info=mem_get_info,
        memory_allocated=memory_allocated,
        max_memory_allocated=max_memory_allocated,
        manual_seed=manual_seed_all,
        manual_seed_all=manual_seed_all,
        is_bf16_supported=lambda: True,
        get_device_name=lambda device=None: "heteroserve simulated device (host memory)",
    )
