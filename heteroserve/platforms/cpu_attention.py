"""The CPU's paged decode attention kernel (csrc/paged_decode_attention.cpp), compiled on first use.

The reference gathers every request's K/V blocks into a padded batch and runs SDPA over it; in scenario B
(64 requests, ~140 tokens) that copy alone took ~26 ms of a ~178 ms decode step. The kernel reads the cache
in place instead. It is built for this machine's CPU (-march=native), so its build directory is named by a
hash of the CPU's flags, the compiler flags, torch's version and the source: a cache shared between
different CPUs, or left over from another torch, is never loaded. Building takes ~7 s on 2 cores;
later processes load the cached library.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform as pyplatform
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "paged_decode_attention.cpp"
# -fopenmp: at::parallel_for's OpenMP region (it links to the libgomp torch has loaded, one thread team);
# reassociation lets dot products and sums vectorise as trees (a serial lane-by-lane sum made the kernel 2x slower).
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math"]
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class PagedDecodeAttention:
    """reference_ops.decode_attention's signature and numerics (float32 accumulation), without the gather."""

    kernel_name = "cpp paged decode attention"

    def __call__(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        mask: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        return torch.ops.heteroserve.paged_decode_attention(q, k_cache, v_cache, block_tables, mask, scale)


def _cpu_flags() -> str:
    """Every ISA flag of this CPU (x86 'flags', arm64 'Features'), plus the architecture."""
    flags = set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                name, _, value = line.partition(":")
                if name.strip() in ("flags", "Features"):
                    flags.update(value.split())
    except OSError:
        pass
    return " ".join([pyplatform.machine(), *sorted(flags)])


def build_directory() -> Path:
    """$TORCH_EXTENSIONS_DIR or ~/.cache/heteroserve/extensions, then one folder per (CPU, torch, source)."""
    key = "\n".join([_cpu_flags(), " ".join(CFLAGS), torch.__version__, SOURCE.read_text()])
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "heteroserve" / "extensions"
    return Path(root) / f"paged_decode_attention_{digest}"


@functools.cache
def paged_decode_attention() -> PagedDecodeAttention | None:
    """The kernel, built or loaded from the cache once per process; None (after one warning) when it cannot be
    built here, e.g. without a C++ compiler: the caller then keeps the reference."""
    try:
        from torch.utils.cpp_extension import load  # imports setuptools: only when the kernel is wanted

        directory = build_directory()
        directory.mkdir(parents=True, exist_ok=True)
        load(
            name=directory.name,
            sources=[str(SOURCE)],
            extra_cflags=CFLAGS,
            extra_ldflags=["-fopenmp"],
            build_directory=str(directory),
            is_python_module=False,
        )
        return PagedDecodeAttention()
    except Exception as exc:  # noqa: BLE001 - any build or load failure means "use the reference"
        logger.warning("the CPU paged decode attention kernel could not be built (%s); using the reference", exc)
        return None
