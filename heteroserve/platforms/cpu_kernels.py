"""The CPU platform's C++ kernels (csrc/), compiled into one library on first use.

- `decode_attention` (csrc/paged_decode_attention.cpp): the reference gathers every request's K/V blocks into
  a padded batch and runs SDPA over it; in scenario B (64 requests, ~140 tokens) that copy alone took ~26 ms of
  a ~178 ms decode step. The kernel reads the cache in place.
- `rms_norm`, `silu_and_mul`, `rotary` (csrc/fused_elementwise.cpp): one pass over memory each instead of the
  reference's chain of torch operators; float32 only.
- `torch.ops.heteroserve.pack_linear_weight` / `packed_linear` (csrc/packed_linear.cpp): the float32 GEMM for
  every batch size, called by cpu_packed.CpuPackedWeight through the platform's linear op; `int4_panel_linear`
  (csrc/int4_panel_linear.cpp) runs the same tile on 4-bit weights dequantised block by block (cpu_int4).
- `torch.ops.heteroserve.decode_layer` (csrc/decode_layer.cpp): the kernels above chained for one decoder layer
  of a decode-only step (cpu_decode_layer.py), so that no Python runs between them.
- `torch.ops.heteroserve.int8_grouped_linear` (csrc/int8_grouped_linear.cpp): grouped 8-bit weights read in
  place for decode batches, called by cpu_int8.CpuGroupedInt8Weight rather than through the operator table;
  `int8_grouped_dequantize` expands the slices larger batches multiply in cache.

The library is built for this machine's CPU (-march=native), so its build directory is named by a hash of the
CPU's flags, the compiler flags, torch's version and the sources: a cache shared between different CPUs, or
left over from another torch, is never loaded. Building takes ~10 s on 2 cores; later processes load the
cached library.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform as pyplatform
import time
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
SOURCES = sorted(CSRC.glob("*.cpp"))
HEADERS = sorted(CSRC.glob("*.h"))
# -fopenmp: at::parallel_for's OpenMP region (it links to the libgomp torch has loaded, one thread team);
# reassociation lets dot products and sums vectorise as trees (a serial lane-by-lane sum made the kernel 2x slower).
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math"]
ATTENTION_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
STALE_LOCK_SECONDS = 600  # a full build takes ~10-90 s on 2 cores


class PagedDecodeAttention:
    """reference_ops.decode_attention's signature and numerics (float32 accumulation), without the gather."""

    kernel_name = "cpp paged decode attention"

    def __call__(self, q, k_cache, v_cache, block_tables, mask, scale: float) -> torch.Tensor:
        return torch.ops.heteroserve.paged_decode_attention(q, k_cache, v_cache, block_tables, mask, scale)


class FusedRmsNorm:
    kernel_name = "cpp fused rms_norm"

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return torch.ops.heteroserve.rms_norm(x, weight, eps)


class FusedSiluAndMul:
    kernel_name = "cpp fused silu_and_mul"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.heteroserve.silu_and_mul(x)


class FusedRotary:
    kernel_name = "cpp fused rotary"

    def __call__(self, positions, q, k, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.ops.heteroserve.rotary(positions, q, k, cos, sin)


def kernels_for(dtype: torch.dtype) -> dict:
    """The C++ kernel per operator name for activations of this dtype; empty when the library cannot be built."""
    if not load_library():
        return {}
    kernels = {"decode_attention": PagedDecodeAttention()} if dtype in ATTENTION_DTYPES else {}
    if dtype == torch.float32:
        kernels.update(rms_norm=FusedRmsNorm(), silu_and_mul=FusedSiluAndMul(), rotary=FusedRotary())
    return kernels


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
    """$TORCH_EXTENSIONS_DIR or ~/.cache/heteroserve/extensions, then one folder per (CPU, torch, sources)."""
    sources = [path.read_text() for path in [*SOURCES, *HEADERS]]
    key = "\n".join([_cpu_flags(), " ".join(CFLAGS), torch.__version__, *sources])
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "heteroserve" / "extensions"
    return Path(root) / f"heteroserve_cpu_kernels_{digest}"


@functools.cache
def load_library() -> bool:
    """Builds or loads the library once per process; False (after one warning) when it cannot be built here,
    e.g. without a C++ compiler: the platform then keeps the reference operators."""
    try:
        directory = build_directory()
        directory.mkdir(parents=True, exist_ok=True)
        compile_and_load(directory, CFLAGS)
        return True
    except Exception as exc:  # noqa: BLE001 - any build or load failure means "use the reference"
        logger.warning("the CPU C++ kernels could not be built (%s); using the torch reference operators", exc)
        return False


def compile_and_load(directory: Path, cflags: list[str]) -> None:
    """Compiles the sources with `cflags` into `directory` (named after it) and registers their operators in
    torch.ops.heteroserve; a process can hold one such build.

    A directory that already holds the library is loaded without torch's build step: that step takes a lock
    file in the directory for every process (to run ninja, which then has nothing to do), and a process killed
    inside it (a worker stopped while starting, a server killed at start-up) left the lock behind, so every later
    start waited on it forever. The directory's name is a hash of everything that goes into the library
    (build_directory), so a library found there is the one these sources make."""
    library = directory / f"{directory.name}.so"
    if library.exists():
        torch.ops.load_library(str(library))
        return
    from torch.utils.cpp_extension import load  # imports setuptools: only when the kernels are wanted

    _remove_stale_lock(directory)
    _put_ninja_on_path()
    load(
        name=directory.name,
        sources=[str(path) for path in SOURCES],
        extra_cflags=cflags,
        extra_include_paths=[str(CSRC)],
        extra_ldflags=["-fopenmp"],
        build_directory=str(directory),
        is_python_module=False,
    )


def _remove_stale_lock(directory: Path) -> None:
    """A build lock older than any build (the process that took it died): torch would wait on it forever."""
    lock = directory / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return
    if age > STALE_LOCK_SECONDS:
        logger.warning("removing %s, left %.0f s ago by a build that did not finish", lock, age)
        lock.unlink(missing_ok=True)


def _put_ninja_on_path() -> None:
    """torch runs `ninja` from PATH, where the pip package's binary is only inside an activated venv (a server
    started as `.venv/bin/heteroserve serve` would otherwise lose its kernels)."""
    try:
        import ninja
    except ImportError:
        return
    path = os.environ.get("PATH", "")
    if ninja.BIN_DIR not in path.split(os.pathsep):
        os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, path]) if path else ninja.BIN_DIR
