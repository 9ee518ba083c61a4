"""x86-64 and aarch64 CPUs."""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import logging
import math
import mmap
import os
import platform as pyplatform
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from heteroserve.config import DEFAULT_CPU_KV_CACHE_BYTES
from heteroserve.platforms.cpu import kernels as cpu_kernels
from heteroserve.platforms.cpu.decode_layer import fuse_decode_layer
from heteroserve.platforms.cpu.int4 import CpuInt4Weight
from heteroserve.platforms.cpu.int8 import CpuGroupedInt8Weight, CpuInt8Weight
from heteroserve.platforms.cpu.moe_experts import experts_fuser
from heteroserve.platforms.cpu.packed import CpuPackedWeight, bfloat16_gemm_available, bfloat16_gemm_kernel
from heteroserve.platforms.interface import Platform
from heteroserve.platforms.operators import REFERENCE_LINEAR, DecodeLayerFuser, ExpertsFuser, Kernel, LinearOp
from heteroserve.quantization.act_order import PermutedInput
from heteroserve.quantization.int4 import Int4Weight
from heteroserve.quantization.int8 import Int8Weight
from heteroserve.quantization.weight import CompressedWeight

logger = logging.getLogger(__name__)

# How long a kernel thread waits for the next kernel before it sleeps: the kernels of one step follow each other
# within microseconds, the next step comes after milliseconds of Python
# (bench/results/kernel_threads-amd-epyc-zen4-2026-12-02-ae38d6e/).
DEFAULT_KERNEL_SPIN_US = 200
# Kernel flag -> the name people know; the flags that decide which kernels and dtypes are fast.
ISA_NAMES = {
    "avx2": "AVX2",
    "avx512f": "AVX-512",
    "avx512_bf16": "AVX512-BF16",
    "amx_tile": "AMX",
    "amx_bf16": "AMX-BF16",
    "asimd": "NEON",
    "asimdhp": "NEON-FP16",
    "asimddp": "NEON-DotProd",
    "sve": "SVE",
    "sve2": "SVE2",
    "bf16": "ARM-BF16",
}
# arm64 hardware capability bits (linux/arch/arm64/include/uapi/asm/hwcap.h): flag -> (auxv type, bit).
_AT_HWCAP, _AT_HWCAP2 = 16, 26
_ARM64_HWCAPS = {
    "asimd": (_AT_HWCAP, 1 << 1),
    "asimdhp": (_AT_HWCAP, 1 << 10),
    "asimddp": (_AT_HWCAP, 1 << 20),
    "sve": (_AT_HWCAP, 1 << 22),
    "sve2": (_AT_HWCAP2, 1 << 1),
    "bf16": (_AT_HWCAP2, 1 << 14),
}
_X86_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16")


def is_arm64(machine: str | None = None) -> bool:
    return (machine or pyplatform.machine()).lower() in ("aarch64", "arm64")


def _arm64_hwcaps() -> set[str]:
    """The arm64 extensions from the ELF auxiliary vector: what the kernel (or qemu-user, whose
    /proc/cpuinfo is the host's) grants this process. Empty where libc has no getauxval."""
    try:
        getauxval = ctypes.CDLL(None).getauxval
    except (OSError, AttributeError):
        return set()
    getauxval.restype = ctypes.c_ulong
    getauxval.argtypes = [ctypes.c_ulong]
    words = {kind: getauxval(kind) for kind in (_AT_HWCAP, _AT_HWCAP2)}
    return {flag for flag, (kind, bit) in _ARM64_HWCAPS.items() if words[kind] & bit}


def _cpuinfo_flags(key: str) -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                name, _, value = line.partition(":")
                if name.strip() == key:
                    return set(value.split())
    except OSError:
        pass
    return set()


def cpu_isa_flags() -> set[str]:
    """Instruction-set extensions of this CPU: arm64 hardware capabilities, or x86 /proc/cpuinfo 'flags'.
    Only the current architecture's flags count, so an emulated arm64 process never reports AVX."""
    if is_arm64():
        return _arm64_hwcaps() or (_cpuinfo_flags("Features") & set(_ARM64_HWCAPS))
    return _cpuinfo_flags("flags") & set(_X86_FLAGS)


def isa_names(flags: set[str]) -> list[str]:
    """The detected extensions by their usual names (AVX-512, AMX, NEON, SVE), in a fixed order."""
    return [name for flag, name in ISA_NAMES.items() if flag in flags]


@functools.cache
def _threads_at_start() -> int:
    return torch.get_num_threads()


def process_threads() -> int:
    """The threads this process runs on: HETEROSERVE_NUM_THREADS, else torch's count as it was before any engine
    changed it (the cores, or the share a tensor-parallel worker was started with). Read before the first
    engine's `configure_process`, so a second engine in the process, and a bench's peers, get the same."""
    return int(os.environ.get("HETEROSERVE_NUM_THREADS") or _threads_at_start())


@contextlib.contextmanager
def torch_at_process_threads() -> Iterator[None]:
    """torch's OpenMP team at `process_threads()` for the block, then back to what it was (one thread once our
    pool owns the cores): plain torch work, or an in-process bench peer, beside the engine."""
    previous = torch.get_num_threads()
    torch.set_num_threads(process_threads())
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def host_memory() -> tuple[int, int]:
    """(available, total) bytes of host memory, from /proc/meminfo where there is one."""
    try:
        with open("/proc/meminfo") as f:
            fields = {key: int(value.split()[0]) * 1024 for key, _, value in (line.partition(":") for line in f)}
        return fields["MemAvailable"], fields["MemTotal"]
    except (OSError, KeyError, ValueError):
        page = os.sysconf("SC_PAGE_SIZE")
        return os.sysconf("SC_AVPHYS_PAGES") * page, os.sysconf("SC_PHYS_PAGES") * page


class CpuLinear(LinearOp):
    """Float32 weights packed once for our C++ GEMM (packed.py: one kernel for every batch size, reading the
    weight as one stream), bfloat16 ones for its bfloat16 twin; without the C++ library they are repacked once for
    oneDNN. 4-bit weights go to our 4-bit kernel (CpuInt4Weight), 8-bit ones stay 8-bit under our 8-bit kernels
    (CpuGroupedInt8Weight, float32 arithmetic); without the C++ library, per-channel 8-bit weights go to torch's
    int8 kernel (CpuInt8Weight), grouped ones to slices dequantised in cache with float32 activations, and with
    other activation dtypes they are expanded once at load. A format left to the reference is said at start-up
    and counted (LinearOp.keep_reference)."""

    PACK_ROWS = 64  # the batch size oneDNN's layout is tuned for; other sizes work too

    def __init__(
        self,
        dtype: torch.dtype = torch.float32,
        packed_float32: bool = False,
        packed_bfloat16: bool = False,
        int4_kernel: bool = False,
        int8_kernel: bool = False,
    ) -> None:
        super().__init__(
            {
                torch.Tensor: self._prepare_dense,
                Int4Weight: self._prepare_int4,
                Int8Weight: self._prepare_int8,
                PermutedInput: self._prepare_permuted,
            }
        )
        self.dtype = dtype  # of the activations; weights expanded at load take it
        self.packed_float32 = packed_float32 and dtype == torch.float32
        self.packed_bfloat16 = packed_bfloat16 and dtype == torch.bfloat16
        self.int4_kernel = int4_kernel
        self.int8_kernel = int8_kernel
        self.name = "cpp packed gemm" if self.packed_float32 or self.packed_bfloat16 else "onednn-packed"

    def _prepare_dense(self, weight: torch.Tensor) -> torch.Tensor | CpuPackedWeight:
        # A float32 weight under bfloat16 activations (prepare_lm_head's 8-bit head) stays float32, as in oneDNN;
        # so does a bfloat16 one whose K the bfloat16 kernel cannot read in pairs (results rounded to bfloat16).
        if self.packed_float32 or (weight.dtype == torch.float32 and self.packed_bfloat16):
            return CpuPackedWeight.pack(weight)
        if self.packed_bfloat16:
            if CpuPackedWeight.bfloat16_supports(weight):
                return CpuPackedWeight.pack(weight, torch.bfloat16)
            return CpuPackedWeight.pack(weight)
        return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), self.PACK_ROWS)

    def _prepare_int4(self, weight: Int4Weight) -> Int4Weight | CpuInt4Weight:
        if not self.int4_kernel:
            return self.keep_reference(weight, "the C++ kernels are not loaded")
        if not CpuInt4Weight.supports(weight):
            return self.keep_reference(weight, f"{weight.shape[0]} output rows are not a multiple of 64")
        return CpuInt4Weight.pack(weight)

    def _prepare_int8(self, weight: Int8Weight) -> torch.Tensor | CompressedWeight:
        # Our kernels first: float32 arithmetic at every batch size, on the pool that owns the cores (torch's
        # int8 kernel rounds activations to bfloat16 up to 16 rows, and runs on torch's threads).
        if weight.group_size % 16 == 0 and cpu_kernels.load_library():
            return CpuGroupedInt8Weight(weight)
        if self.int8_kernel and CpuInt8Weight.supports(weight):
            return CpuInt8Weight.pack(weight)
        if self.dtype == torch.float32:
            return CpuGroupedInt8Weight(weight)
        return self._prepare_dense(weight.dequantize(self.dtype))

    def planned_formats(self) -> dict[str, str]:
        kernels = {"dense": bfloat16_gemm_kernel() if self.packed_bfloat16 else self.name}
        kernels["int4"] = (
            "cpp int4 panel linear (float32 arithmetic)"
            if self.int4_kernel
            else f"{REFERENCE_LINEAR}: the C++ kernels are not loaded"
        )
        if cpu_kernels.load_library():
            kernels["int8"] = "cpp grouped int8 linear (float32 arithmetic)"
        elif self.int8_kernel:
            kernels["int8"] = "torch int8 kernel (per-channel), else dequantised in cache slices"
        else:
            kernels["int8"] = "dequantised in cache slices" if self.dtype == torch.float32 else "expanded at load"
        return kernels

    def _prepare_permuted(self, weight: PermutedInput) -> torch.Tensor | CompressedWeight:
        inner = self.prepare(weight.weight)
        if isinstance(inner, torch.Tensor):  # expanded to float anyway: back in input order, no gather needed
            return self.prepare(weight.dequantize(self.dtype))
        return PermutedInput(inner, weight.order)

    def prepare_lm_head(self, weight: torch.Tensor | CompressedWeight) -> torch.Tensor | CompressedWeight:
        # An 8-bit LM head (a tied Q8_0 embedding) multiplies in float32 even where the int8 kernel exists: with
        # activations in bfloat16 the default model's answer to "What is the capital of France?" turned into
        # "L'Étoile, la Marseillaise, ...".
        if self.packer_for(weight) == self._prepare_int8:
            if self.dtype == torch.float32:
                return CpuGroupedInt8Weight(weight)
            prepared = self.prepare(weight.dequantize())
        else:
            prepared = self.prepare(weight)
        if isinstance(prepared, CpuPackedWeight) and self.dtype != torch.float32:
            # bfloat16 logits are 1/8 apart near 20, close enough to swap the argmax of near ties: float32
            # logits agree with the float32 model more often (`bench quality`; bench/results/HISTORY.md)
            return dataclasses.replace(prepared, float_output=True)
        return prepared

    def __call__(
        self, x: torch.Tensor, weight: torch.Tensor | CompressedWeight, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        if isinstance(weight, torch.Tensor):  # oneDNN's reordered layout
            # x widened where the weight is float32 under bfloat16 activations (prepare_lm_head's 8-bit head)
            return torch.ops.mkldnn._linear_pointwise(x.to(weight.dtype), weight, bias, "none", [], "")
        self.count_reference(weight)
        return weight.matmul(x, bias)


def _int8_kernel_works() -> bool:
    """torch's CPU int8 kernel exists and computes x (q * scale)^T."""
    try:
        gen = torch.Generator().manual_seed(0)
        q = torch.randint(-127, 128, (32, 64), dtype=torch.int8, generator=gen)
        w = Int8Weight(q, torch.rand(32, 1, generator=gen) + 0.5, 64)
        x = torch.randn(2, 64, generator=gen)
        expected = x @ w.dequantize().T
        return float((CpuInt8Weight.pack(w).matmul(x, None) - expected).norm() / expected.norm()) < 1e-2
    except (RuntimeError, AttributeError):
        return False


def _onednn_works(dtype: torch.dtype) -> bool:
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        op = CpuLinear(dtype)
        w = torch.randn(8, 16, dtype=dtype)
        x = torch.randn(3, 16, dtype=dtype)
        return torch.allclose(op(x, op.prepare(w)).float(), (x @ w.T).float(), rtol=1e-2, atol=1e-2)
    except (RuntimeError, AttributeError):
        return False


def transparent_huge_pages() -> str:
    """The kernel's transparent huge page mode (always, madvise or never; unknown off Linux)."""
    try:
        setting = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return "unknown"
    return setting[setting.index("[") + 1 : setting.index("]")] if "[" in setting else "unknown"


class CpuPlatform(Platform):
    name = "cpu"
    device_type = "cpu"
    dist_backend = "gloo"
    ray_resource = "CPU"

    @classmethod
    def is_available(cls) -> bool:
        return True

    def __init__(self) -> None:
        super().__init__()
        self.isa = cpu_isa_flags()
        self.threads = process_threads()  # the process's share of the cores

    def supported_dtypes(self) -> list[torch.dtype]:
        dtypes = [torch.float32]
        # bfloat16 products on AVX512-BF16's instruction, else widened in registers by our kernels (half the
        # bytes of float32 for a memory-bound decode on AVX2 and NEON)
        if self.isa & {"avx512_bf16", "amx_bf16", "bf16", "sve"} or bfloat16_gemm_available():
            dtypes.append(torch.bfloat16)
        if "amx_tile" in self.isa or is_arm64():
            dtypes.append(torch.float16)
        return dtypes

    def linear_op(self, dtype: torch.dtype, kernels: str = "auto") -> LinearOp:
        if kernels != "auto":
            return LinearOp()
        packed_float32 = dtype == torch.float32 and cpu_kernels.load_library()
        packed_bfloat16 = dtype == torch.bfloat16 and bfloat16_gemm_available()
        if packed_float32 or packed_bfloat16 or (dtype in (torch.float32, torch.bfloat16) and _onednn_works(dtype)):
            return CpuLinear(
                dtype,
                packed_float32=packed_float32,
                packed_bfloat16=packed_bfloat16,
                int4_kernel=cpu_kernels.load_library(),
                int8_kernel=_int8_kernel_works(),
            )
        return LinearOp()

    def operator_kernels(self, dtype: torch.dtype, kernels: str = "auto") -> dict[str, Kernel]:
        """The reference, with the C++ kernels (built on first use) in place of the operators they cover."""
        table = super().operator_kernels(dtype, kernels)
        if kernels == "auto":
            table.update({name: k for name, k in cpu_kernels.kernels_for(dtype).items() if name in table})
        return table

    def decode_layer_fuser(self, dtype: torch.dtype, kernels: str = "auto") -> DecodeLayerFuser | None:
        """The fused layer chains this platform's own C++ kernels, so a subclass that brings other kernels (a
        vendor plugin built on the CPU platform) keeps them on every step unless it overrides this as well."""
        return fuse_decode_layer if self._chains_own_kernels(dtype, kernels) else None

    def experts_fuser(self, dtype: torch.dtype, kernels: str = "auto") -> ExpertsFuser | None:
        """As decode_layer_fuser: this platform's own C++ kernels, chained over a MoE layer's chosen experts."""
        return experts_fuser(dtype) if self._chains_own_kernels(dtype, kernels) else None

    def _chains_own_kernels(self, dtype: torch.dtype, kernels: str) -> bool:
        """Whether one-call chains of this platform's C++ kernels may run: its own kernels in use (not a plugin's
        in their place), all of them, in a dtype they compute natively."""
        own_kernels = type(self).operator_kernels is CpuPlatform.operator_kernels and not self.unsupported_operators
        native = dtype == torch.float32 or (dtype == torch.bfloat16 and bfloat16_gemm_available())
        return own_kernels and kernels == "auto" and native and cpu_kernels.load_library()

    def kv_cache_budget_bytes(
        self, requested: int | None, memory_utilization: float | None = None, wanted: int | None = None
    ) -> int:
        """Host memory is shared with everything else on the machine, so the CPU never takes a share of RAM: unless
        the user sets the size, the pool holds what the engine's limits can fill (`wanted`: max_num_seqs requests
        of max_model_len), at most DEFAULT_CPU_KV_CACHE_BYTES (as vLLM's VLLM_CPU_KVCACHE_SPACE) and a quarter of
        the memory available now."""
        if memory_utilization is not None:
            logger.warning("gpu_memory_utilization is for devices; on CPU set kv_cache_memory_bytes instead")
        if requested is not None:
            return requested
        available, _ = self.memory_info()
        return min(DEFAULT_CPU_KV_CACHE_BYTES, available // 4, *([wanted] if wanted is not None else []))

    def allocate_kv_cache(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Zeroed host memory in transparent huge pages (2 MiB) where the kernel offers them, all taken at
        allocation. Pages taken as blocks are first written cost a busy step its faults instead: 4 KiB pages fault
        a page per layer and block, and a first write into a huge page waits for the kernel to compact one (the
        `madvise` defrag mode), which cost scenario C ~12% of its throughput (bench/results). The pool's size is
        what the engine's limits can fill (kv_cache_budget_bytes), so a small server still takes little memory."""
        size = math.prod(shape) * dtype.itemsize
        pages = mmap.mmap(-1, max(size, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if transparent_huge_pages() == "never":
            logger.info("KV cache in 4 KiB pages (transparent huge pages are off)")
        else:
            pages.madvise(mmap.MADV_HUGEPAGE)
        words = np.frombuffer(pages, dtype=np.uint8, count=size)
        words[:: mmap.PAGESIZE] = 0  # one write a page takes it now, not in a step
        return torch.from_numpy(words).view(dtype).view(shape)

    def memory_info(self) -> tuple[int, int]:
        return host_memory()

    def synchronize(self) -> None:
        """CPU kernels finish before they return."""

    def empty_cache(self) -> None:
        """The CPU allocator keeps no cache of its own."""

    def bind_rank(self, local_rank: int) -> None:
        """CPU ranks share the host; each worker process takes its share of the cores instead."""

    def configure_process(self) -> None:
        """The process's thread count: HETEROSERVE_NUM_THREADS, else torch's (the cores, or a tensor-parallel
        rank's share), for the C++ kernels' own pool (loading the model packs weights there). The pool's threads
        spin for HETEROSERVE_KERNEL_SPIN_US after a kernel (the next one of a step follows within microseconds),
        then sleep; OpenMP's variables (OMP_WAIT_POLICY, GOMP_SPINCOUNT) do not reach it."""
        self.threads = process_threads()
        # torch's team starts only if assign_threads asks for it: under OMP_WAIT_POLICY=ACTIVE its threads, once
        # started, spin for the process's life against the pool's threads on the same cores
        # (bench/results/kernel_threads-amd-epyc-zen4-2026-12-02-ae38d6e/).
        own_kernels = cpu_kernels.load_library()
        torch.set_num_threads(1 if own_kernels else self.threads)
        if own_kernels:
            spin_us = int(os.environ.get("HETEROSERVE_KERNEL_SPIN_US", DEFAULT_KERNEL_SPIN_US))
            torch.ops.heteroserve.set_kernel_threads(self.threads, spin_us)

    def assign_threads(self, dtype: torch.dtype, kernels: str = "auto") -> None:
        """One team of threads owns the cores. Where our GEMM runs the products (float32 or bfloat16 activations
        with the C++ library loaded) the C++ kernels' pool runs every product, attention and norm, and torch's operators
        (the glue between them) get one thread: an OpenMP team beside the pool spins after each parallel torch
        operator on the cores the pool needs, and the pool's kernels wait for those cores
        (bench/results/kernel_threads-amd-epyc-zen4-2026-12-02-ae38d6e/, docs/PLATFORMS.md, "CPU kernels").
        Where oneDNN or the torch reference runs them, torch's team gets the threads and the pool keeps only its
        caller's thread so as not to spin against it."""
        if cpu_kernels.load_library():
            _, spin_us = torch.ops.heteroserve.kernel_thread_settings()
            own_products = kernels == "auto" and (
                dtype == torch.float32 or (dtype == torch.bfloat16 and bfloat16_gemm_available())
            )
            torch.ops.heteroserve.set_kernel_threads(self.threads if own_products else 1, spin_us)
            torch.set_num_threads(1 if own_products else self.threads)
        logger.info("CPU threads: %s", ", ".join(f"{k}={v}" for k, v in self.thread_settings().items()))

    def torch_operators(self) -> contextlib.AbstractContextManager[None]:
        """torch's team gets the process's threads while plain torch operators run (a vision tower: nn.Linear and
        SDPA), and one thread again afterwards where the pool owns the cores."""
        return torch_at_process_threads()

    def thread_settings(self) -> dict[str, object]:
        """The kernels' pool and torch's OpenMP team as this process runs them (start-up log, `heteroserve env`)."""
        settings: dict[str, object] = {}
        if cpu_kernels.load_library():
            threads, spin_us = torch.ops.heteroserve.kernel_thread_settings()
            settings.update(kernel_threads=threads, kernel_spin_us=spin_us)
        settings.update(
            torch_threads=torch.get_num_threads(), omp_wait_policy=os.environ.get("OMP_WAIT_POLICY", "unset")
        )
        return settings

    def describe(self) -> dict[str, object]:
        return {
            **super().describe(),
            "machine": pyplatform.machine(),
            "isa": isa_names(self.isa),
            "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "cpp_kernels": cpu_kernels.loaded_build(),
            **self.thread_settings(),
        }
