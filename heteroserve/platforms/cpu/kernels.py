"""The CPU platform's C++ kernels (csrc/), compiled into one library on first use.

- `decode_attention` (csrc/paged_decode_attention.cpp): the reference gathers every request's K/V blocks into
  a padded batch and runs SDPA over it, a copy of the whole cache a step; the kernel reads the cache in place.
- `prefill_attention` (csrc/prefill_attention.cpp): prompt attention on the GEMM's register tile in float32,
  faster than torch's SDPA at these head sizes (docs/PLATFORMS.md, "CPU kernels").
  `bidirectional_attention` runs an encoder's sequence on the same kernel with every key visible.
- `rms_norm`, `silu_and_mul`, `rotary` (csrc/fused_elementwise.cpp): one pass over memory each instead of the
  reference's chain of torch operators. `argmax_rows` (csrc/argmax_rows.cpp): greedy tokens from the logits in one
  vector pass a row, where torch's `max` reduces more slowly (docs/PLATFORMS.md, "CPU kernels").
- Activations in float32 or bfloat16 (OPERATOR_DTYPES; paged decode attention also float16): bfloat16 values are
  widened as they are read, computed in float32 and rounded once when stored (vector_math.h: AVX512-BF16's
  conversion where -march=native has it, the same rounding in portable code elsewhere).
- `torch.ops.heteroserve.pack_linear_weight` / `packed_linear` (csrc/packed_linear.cpp): the float32 GEMM for
  every batch size, called by packed.CpuPackedWeight through the platform's linear op; `int4_panel_linear`
  (csrc/int4_panel_linear.cpp) multiplies 4-bit weights in float32 at every batch size with one order of
  summation (int4.py): a few rows straight from the nibbles, more on the GEMM's tile shape.
  `pack_bf16_linear_weight` / `bf16_packed_linear` (csrc/bf16_packed_linear.cpp): its bfloat16 twin, on
  AVX512-BF16's dot-product instruction where the compiler targets it, elsewhere with the pairs widened in
  registers (the same layout and sums on every level).
- `torch.ops.heteroserve.decode_layer` / `decode_moe_layer` (csrc/decode_layer.cpp): the kernels above chained
  for one decoder layer of a decode-only step (decode_layer.py), so that no Python runs between them;
  `moe_route` / `moe_experts` (csrc/moe_experts.cpp): a mixture of experts' routing and chosen experts.
- `lora_add` (csrc/lora_products.cpp): a step's adapter products, every segment of rows in one call on register
  tiles, where the reference's padded `bmm` runs these thin products slowly; each row's sums in one order, so a
  request under an adapter gets the same bits alone or batched.
- `torch.ops.heteroserve.int8_grouped_linear` (csrc/int8_grouped_linear.cpp): grouped 8-bit weights read in
  place for decode batches, called by int8.CpuGroupedInt8Weight rather than through the operator table;
  `int8_grouped_dequantize` expands the slices larger batches multiply in cache.

The library is built for this machine's CPU (-march=native), so its build directory is named by a hash of the
CPU's flags, the compiler flags, torch's version and the sources: a cache shared between different CPUs, or
left over from another torch, is never loaded. Building takes ~10-60 s on 2 cores; later processes load the
cached library. Where it cannot be built (no compiler: the container image), the build prebuilt for the CPU's
instruction-set level is loaded instead (cpu/kernel_variants.py, `heteroserve build-kernels --prebuilt`).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform as pyplatform
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

from heteroserve.platforms import reference_ops
from heteroserve.platforms.cpu import kernel_variants as variants

logger = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
SOURCES = sorted(CSRC.glob("*.cpp"))
HEADERS = sorted(CSRC.glob("*.h"))
# No -fopenmp: the kernels run on their own thread pool (csrc/thread_pool.h), whatever OpenMP's settings are;
# reassociation lets dot products and sums vectorise as trees instead of a serial lane-by-lane sum.
CFLAGS = ["-O3", "-march=native", "-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math"]
ATTENTION_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# The dtypes of the other operators' kernels (norms, rotary, SiLU, prefill attention, argmax).
OPERATOR_DTYPES = (torch.float32, torch.bfloat16)
STALE_LOCK_SECONDS = 600  # a full build takes ~10-90 s on 2 cores
_loaded_build: str | None = None  # set by load_library


def _named(modifiers) -> str:
    """The score modifiers a layer asked for, by name (attention.ScoreModifiers)."""
    names = {"softcap": "logit soft-capping", "sinks": "attention sinks"}
    return ", ".join(names[n] for n in names if getattr(modifiers, n) is not None)


class PagedDecodeAttention:
    """reference_ops.decode_attention's signature and numerics (float32 accumulation), without the gather."""

    kernel_name = "cpp paged decode attention"

    def __call__(self, q, k_cache, v_cache, block_tables, mask, scale: float, modifiers=None):
        if modifiers is not None:
            raise NotImplementedError(f"score modifiers ({_named(modifiers)}) are not implemented in this kernel")
        return torch.ops.heteroserve.paged_decode_attention(q, k_cache, v_cache, block_tables, mask, scale)


class PrefillAttention:
    """Head sizes that are not a whole number of the tile's panels keep the reference (torch's SDPA)."""

    kernel_name = "cpp prefill attention (GEMM tile)"

    def __call__(self, q, keys, values, mask, scale: float, modifiers=None) -> torch.Tensor:
        if modifiers is not None:
            raise NotImplementedError(f"score modifiers ({_named(modifiers)}) are not implemented in this kernel")
        if not torch.ops.heteroserve.prefill_attention_supports(q.shape[-1]):
            return reference_ops.prefill_attention(q, keys, values, mask, scale)
        return torch.ops.heteroserve.prefill_attention(q, keys, values, mask, scale)


class BidirectionalAttention:
    """An encoder sequence on the prefill kernel with every key visible (no mask to build or read); head sizes off
    the tile keep the reference."""

    kernel_name = "cpp prefill attention (GEMM tile), not causal"

    def __call__(self, q, keys, values, scale: float) -> torch.Tensor:
        if not torch.ops.heteroserve.prefill_attention_supports(q.shape[-1]):
            return reference_ops.bidirectional_attention(q, keys, values, scale)
        return torch.ops.heteroserve.prefill_attention(q, keys, values, None, scale, False)


class FusedRmsNorm:
    kernel_name = "cpp fused rms_norm"

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return torch.ops.heteroserve.rms_norm(x, weight, eps)


class FusedSiluAndMul:
    kernel_name = "cpp fused silu_and_mul"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.heteroserve.silu_and_mul(x)


class ArgmaxRows:
    kernel_name = "cpp argmax_rows"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.heteroserve.argmax_rows(x)


class LoRAProducts:
    kernel_name = "cpp segmented lora products"

    def __call__(self, y: torch.Tensor, x: torch.Tensor, a_t: torch.Tensor, b_t: torch.Tensor, rows) -> torch.Tensor:
        if y.is_contiguous():
            return torch.ops.heteroserve.lora_add(y, x, a_t, b_t, rows.segments)
        return y.copy_(torch.ops.heteroserve.lora_add(y.contiguous(), x, a_t, b_t, rows.segments))


class FusedRotary:
    kernel_name = "cpp fused rotary"

    def __call__(self, positions, q, k, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.ops.heteroserve.rotary(positions, q, k, cos, sin)


def kernels_for(dtype: torch.dtype) -> dict:
    """The C++ kernel per operator name for activations of this dtype; empty when the library cannot be built."""
    if not load_library():
        return {}
    kernels = {"decode_attention": PagedDecodeAttention()} if dtype in ATTENTION_DTYPES else {}
    if dtype in OPERATOR_DTYPES:
        kernels.update(
            rms_norm=FusedRmsNorm(),
            silu_and_mul=FusedSiluAndMul(),
            rotary=FusedRotary(),
            prefill_attention=PrefillAttention(),
            bidirectional_attention=BidirectionalAttention(),
            argmax_rows=ArgmaxRows(),
            lora_add=LoRAProducts(),
        )
    return kernels


def cpu_flags() -> str:
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


def library_directory(root: Path, name: str, flags: list[str]) -> Path:
    """root/name_<hash of `flags`, torch's version and the sources>: a library built from anything else is never
    loaded."""
    sources = [path.read_text() for path in [*SOURCES, *HEADERS]]
    key = "\n".join([" ".join(flags), torch.__version__, *sources])
    return root / f"{name}_{hashlib.sha256(key.encode()).hexdigest()[:16]}"


def extensions_root() -> Path:
    """$TORCH_EXTENSIONS_DIR or ~/.cache/heteroserve/extensions: where this machine's builds are kept."""
    return Path(os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "heteroserve" / "extensions")


def build_directory() -> Path:
    """extensions_root(), then one folder per (CPU, torch, sources)."""
    return library_directory(extensions_root(), "heteroserve_cpu_kernels", [cpu_flags(), *CFLAGS])


@functools.cache
def load_library() -> bool:
    """Loads the library once per process: this CPU's own build (made on first use where a C++ compiler is),
    else the prebuilt build of this CPU's instruction-set level (cpu/kernel_variants.py: what the container
    image carries). False, after one warning, where neither loads: the platform then keeps the reference
    operators. $HETEROSERVE_CPU_LEVEL names one level instead (x86_64_v4, x86_64_v3, x86_64, armv8_a): its
    prebuilt build where there is one, else one made for this machine's cache, so that a machine tests the kernels
    of every level it can run."""
    global _loaded_build
    level = os.environ.get(variants.LEVEL_VARIABLE)
    if level:
        variant = variants.forced_variant(level, set(cpu_flags().split()))
        prebuilt = prebuilt_directory(variant)
        if (prebuilt / f"{prebuilt.name}.so").exists():
            torch.ops.load_library(str(prebuilt / f"{prebuilt.name}.so"))
            _loaded_build = f"{variant.name} ({variants.LEVEL_VARIABLE}, prebuilt)"
            return True
        directory = library_directory(
            extensions_root(),
            f"heteroserve_cpu_kernels_{variant.name}",
            [cpu_flags(), *variants.variant_cflags(variant, CFLAGS)],
        )
        directory.mkdir(parents=True, exist_ok=True)
        compile_and_load(directory, variants.variant_cflags(variant, CFLAGS))
        _loaded_build = f"{variant.name} ({variants.LEVEL_VARIABLE})"
        return True
    errors = []
    native = build_directory()
    if (native / f"{native.name}.so").exists() or variants.compiler_available():
        try:
            native.mkdir(parents=True, exist_ok=True)
            compile_and_load(native, CFLAGS)
            _loaded_build = "native"
            return True
        except Exception as exc:  # noqa: BLE001 - any build or load failure: a prebuilt build may still do
            errors.append(f"building for this CPU failed: {exc}")
    else:
        errors.append("no C++ compiler")
    for variant in variants.supported_variants(set(cpu_flags().split())):
        directory = prebuilt_directory(variant)
        library = directory / f"{directory.name}.so"
        if not library.exists():
            errors.append(f"no prebuilt {variant.name} build at {library}")
            continue
        try:
            torch.ops.load_library(str(library))
            _loaded_build = f"prebuilt {variant.name}"
            return True
        except Exception as exc:  # noqa: BLE001 - unloadable: the reference remains
            errors.append(f"the prebuilt {variant.name} build did not load: {exc}")
            break
    logger.warning(
        "the CPU C++ kernels could not be loaded (%s); using the torch reference operators", "; ".join(errors)
    )
    return False


@functools.cache
def int8_panel_available() -> bool:
    """Whether the library has the 8-bit panel GEMM (int8_grouped_linear.cpp; AVX-512 builds)."""
    return load_library() and bool(torch.ops.heteroserve.int8_panel_available())


def loaded_build() -> str:
    """Which build of the library this process runs: "native", "prebuilt <level>", "<level>
    (HETEROSERVE_CPU_LEVEL)", "<level> (HETEROSERVE_CPU_LEVEL, prebuilt)", or "none"."""
    return _loaded_build if load_library() else "none"


def prebuilt_directory(variant: variants.KernelVariant, root: Path | None = None) -> Path:
    name = f"heteroserve_cpu_kernels_{variant.name}"
    return library_directory(root or variants.prebuilt_root(), name, variants.variant_cflags(variant, CFLAGS))


def build_prebuilt(root: Path) -> list[str]:
    """Builds every instruction-set level of this architecture into `root`, each in its own process (a process
    can hold one build, and loading is the build's last step), keeping only the libraries. A level this CPU
    lacks is built all the same: its process may die of an illegal instruction when it loads the result."""
    built, supported = [], variants.supported_variants(set(cpu_flags().split()))
    for variant in variants.variants_for():
        directory = prebuilt_directory(variant, root)
        code = (
            "import sys; from heteroserve.platforms.cpu import kernels as k; k.build_variant(sys.argv[1], sys.argv[2])"
        )
        run = subprocess.run([sys.executable, "-c", code, variant.name, str(root)], capture_output=True, text=True)
        library = directory / f"{directory.name}.so"
        cpu_has_it = variant in supported
        if not library.exists() or (run.returncode != 0 and cpu_has_it):
            raise RuntimeError(f"building the {variant.name} kernels failed:\n{run.stdout[-2000:]}{run.stderr[-3000:]}")
        for path in directory.iterdir():
            if path != library:
                shutil.rmtree(path) if path.is_dir() else path.unlink()
        built.append(f"{variant.name}: {library}" + ("" if cpu_has_it else " (this CPU cannot run it)"))
    return built


def build_variant(name: str, root: str) -> None:
    variant = next(v for v in variants.variants_for() if v.name == name)
    directory = prebuilt_directory(variant, Path(root))
    directory.mkdir(parents=True, exist_ok=True)
    compile_and_load(directory, variants.variant_cflags(variant, CFLAGS))


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
