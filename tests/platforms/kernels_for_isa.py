"""Builds the CPU kernels as prebuilt for an instruction-set level (cpu_kernel_variants.py) and runs the kernel
tests against that build, in this process: `python tests/platforms/kernels_for_isa.py x86_64_v3` checks the AVX2
code paths (16-wide panels) on an AVX-512 machine, `x86_64` the generic ones (8-wide panels, the layout NEON
gets)."""

from __future__ import annotations

import functools
import sys
import tempfile

import pytest
import torch

from heteroserve.platforms import cpu_kernels

TESTS = [
    "tests/platforms/test_cpu_packed_linear.py",
    "tests/platforms/test_cpu_kernels.py",
    "tests/platforms/test_cpu_decode_layer.py",
    "tests/quantization/test_int4.py",
    "tests/quantization/test_int8.py",
]


def main(level: str) -> int:
    cpu_kernels.build_variant(level, tempfile.mkdtemp())
    cpu_kernels.load_library = functools.cache(lambda: True)  # the ops are registered: never load the native build
    panel = torch.ops.heteroserve.pack_linear_weight(torch.randn(1, 1)).shape[2]
    print(f"{level}: GEMM panels {panel} wide")
    return pytest.main(["-q", "-p", "no:cacheprovider", *TESTS, "-k", "not failed_build and not build_directory"])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
