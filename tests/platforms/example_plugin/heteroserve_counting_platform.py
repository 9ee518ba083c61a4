"""A worked example of a heteroserve platform plugin (docs/PLATFORMS.md), used by the tests.

Its "device" is the CPU, so it runs anywhere, but it brings its own kernel table and counts each call,
which shows that the engine really goes through the plugin. Four entry points share the module:

- `counting`: every operator has a kernel of the plugin's own;
- `partial`: declares rms_norm and decode_attention unsupported, so those run through the CPU fallback;
- `flaky`: its silu_and_mul and prefill_attention kernels raise NotImplementedError at run time;
- `absent`: a plugin whose device is not present on this machine (its function returns None).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import torch

from heteroserve.platforms.cpu import CpuPlatform

KERNEL_CALLS: Counter[str] = Counter()  # operator -> calls that reached this plugin's kernels


def _counted(name: str, kernel: Callable) -> Callable:
    def run(*args):
        KERNEL_CALLS[name] += 1
        return kernel(*args)

    run.kernel_name = f"counting.{name}"
    return run


def _no_kernel(*args):
    raise NotImplementedError("the example device has no kernel for this call")


class CountingPlatform(CpuPlatform):
    name = "counting"

    def operator_kernels(self, dtype: torch.dtype, kernels: str = "auto") -> dict[str, Callable]:
        return {name: _counted(name, kernel) for name, kernel in super().operator_kernels(dtype, kernels).items()}


class PartialPlatform(CountingPlatform):
    name = "partial"
    unsupported_operators = frozenset({"rms_norm", "decode_attention"})


class FlakyPlatform(CountingPlatform):
    name = "flaky"

    def operator_kernels(self, dtype: torch.dtype, kernels: str = "auto") -> dict[str, Callable]:
        table = super().operator_kernels(dtype, kernels)
        table["silu_and_mul"] = _counted("silu_and_mul", _no_kernel)
        table["prefill_attention"] = _counted("prefill_attention", _no_kernel)
        return table


# Entry points: each returns the platform class's qualified name, or None when the device is absent.
def counting() -> str:
    return f"{__name__}.CountingPlatform"


def partial() -> str:
    return f"{__name__}.PartialPlatform"


def flaky() -> str:
    return f"{__name__}.FlakyPlatform"


def absent() -> None:
    return None
