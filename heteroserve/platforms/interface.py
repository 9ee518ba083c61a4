"""The platform interface: every device-specific decision the engine needs, behind one class."""

from __future__ import annotations

import contextlib
import importlib.metadata
from collections import Counter
from collections.abc import Iterator
from types import ModuleType

import torch

from heteroserve.platforms.attention import AttentionBackend
from heteroserve.platforms.graph_capture import GraphCapture
from heteroserve.platforms.operators import (
    OPERATORS,
    DecodeLayerFuser,
    ExpertsFuser,
    Kernel,
    LinearOp,
    OperatorTable,
    means_unsupported,
)
from heteroserve.platforms.paged_attention import PagedAttentionBackend

DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}


class Platform:
    """A device family. Subclasses override what differs; the engine never asks `if device == ...`.

    The defaults suit any device torch exposes as `torch.<device_type>` (cuda, npu, mlu, xpu): memory,
    synchronisation and cache release go through that module; every operator runs the plain-torch reference
    on the device. A subclass that calls `__init__` must call `super().__init__()` (the fallback counter)."""

    name: str = "base"
    device_type: str = "cpu"
    dist_backend: str = "gloo"  # torch.distributed backend for this device's collectives
    # Whether that backend takes host tensors only (gloo beside a device with no collective library of its own):
    # then each collective copies the device tensor to the host and back.
    collectives_through_host: bool = False
    vendor_extension: str | None = None  # the vendor's torch extension distribution (torch_npu, ...)
    unsupported_operators: frozenset[str] = frozenset()  # these run on the CPU (see operators.py)
    memory_utilization: float = 0.9  # share of device memory the weights plus KV cache may take
    device_index: int | None = None  # set by `bind_rank` when several ranks share a node
    ray_resource: str = "GPU"  # the Ray resource one rank of this device takes (Ray's name for it)
    # The dotted name of a heteroserve.worker.model_runner.ModelRunner subclass the worker builds for a decoder instead
    # of ModelRunner: where a device replaces how a step runs (graph capture and replay, its own input buffers).
    model_runner_class: str | None = None

    def __init__(self) -> None:
        self.operator_fallbacks: Counter[str] = Counter()  # calls that ran on the CPU, by operator

    @classmethod
    def is_available(cls) -> bool:
        """Cheap detection: must not fail or be slow when the vendor's extension is absent."""
        raise NotImplementedError

    @property
    def device(self) -> torch.device:
        if self.device_index is None:
            return torch.device(self.device_type)
        return torch.device(self.device_type, self.device_index)

    def distributed_backend(self) -> str:
        """The torch.distributed backend for collectives between this device's ranks (gloo, nccl, hccl, ...)."""
        return self.dist_backend

    def bind_rank(self, local_rank: int) -> None:
        """Gives the rank its own device when several ranks run on one node (one accelerator each)."""
        self.device_index = local_rank
        self.device_module().set_device(local_rank)

    def device_module(self) -> ModuleType:
        """`torch.cuda`, `torch.npu`, ...: the module a vendor extension registers for its device type."""
        return torch.get_device_module(self.device_type)

    def supported_dtypes(self) -> list[torch.dtype]:
        """Dtypes this device computes fast; others are replaced by `default_dtype()` under dtype='auto'."""
        return [torch.float32]

    def default_dtype(self) -> torch.dtype:
        """The dtype used when the checkpoint's is not supported here."""
        return torch.float32

    def resolve_dtype(self, requested: str, checkpoint_dtype: torch.dtype) -> torch.dtype:
        if requested != "auto":
            dtype = DTYPES[requested]
            if dtype not in self.supported_dtypes():
                names = ", ".join(str(d).removeprefix("torch.") for d in self.supported_dtypes())
                raise ValueError(f"dtype {requested} is not supported on {self.name} (supported: {names})")
            return dtype
        return checkpoint_dtype if checkpoint_dtype in self.supported_dtypes() else self.default_dtype()

    def memory_info(self) -> tuple[int, int]:
        """(free, total) bytes of the device's memory."""
        return self.device_module().mem_get_info()

    def kv_cache_budget_bytes(
        self, requested: int | None, memory_utilization: float | None = None, wanted: int | None = None
    ) -> int:
        """Bytes for the KV block pool: the user's figure, else what the utilisation share of the device's
        memory leaves once the weights are loaded (vLLM's --gpu-memory-utilization). `wanted`: what the engine's
        limits can fill (max_num_seqs requests of max_model_len); a device takes its share regardless, as vLLM."""
        if requested is not None:
            return requested
        share = memory_utilization if memory_utilization is not None else self.memory_utilization
        free, total = self.memory_info()
        in_use = total - free
        return max(int(total * share) - in_use, 0)

    def allocate_kv_cache(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A zeroed KV block pool tensor on the device (a masked slot is multiplied by zero, never read as garbage)."""
        return torch.zeros(shape, dtype=dtype, device=self.device)

    def synchronize(self) -> None:
        """Waits for queued device work (for timing)."""
        self.device_module().synchronize()

    def empty_cache(self) -> None:
        """Returns cached, unused device memory to the driver."""
        self.device_module().empty_cache()

    def manual_seed(self, seed: int) -> None:
        """Seeds the host and every device generator torch knows (vendor devices register theirs)."""
        torch.manual_seed(seed)

    def configure_process(self) -> None:
        """Per-process setup such as thread counts; called once before the model loads."""

    def assign_threads(self, dtype: torch.dtype, kernels: str = "auto") -> None:
        """Called once the model has loaded with activations of `dtype` and the `kernels` setting it loaded with:
        how the process's threads are shared between torch's operators and the platform's own kernels from now
        on."""

    @contextlib.contextmanager
    def torch_operators(self) -> Iterator[None]:
        """Around a stretch of plain torch operators that does not go through the platform's kernels (a vision
        tower): the threads torch gets meanwhile. By default nothing changes."""
        yield

    def linear_op(self, dtype: torch.dtype, kernels: str = "auto") -> LinearOp:
        """The matrix-product kernel for weights of this dtype; `kernels="reference"` asks for plain torch."""
        return LinearOp()

    def operator_kernels(self, dtype: torch.dtype, kernels: str = "auto") -> dict[str, Kernel]:
        """The device's kernel per operator name; a name left out runs on the CPU. Vendor platforms add their
        fused kernels here when `kernels == "auto"`; the default is the torch reference on the device."""
        return {name: spec.reference for name, spec in OPERATORS.items() if name not in self.unsupported_operators}

    def is_unsupported_error(self, exc: BaseException) -> bool:
        """Whether a kernel's exception means "this device cannot do that" (then the CPU runs it)."""
        return means_unsupported(exc)

    def operator_table(self, dtype: torch.dtype, kernels: str = "auto") -> OperatorTable:
        """What the model calls; its CPU fallbacks are counted in `self.operator_fallbacks`."""
        return OperatorTable(
            self.linear_op(dtype, kernels),
            self.operator_kernels(dtype, kernels),
            self.operator_fallbacks,
            self.is_unsupported_error,
            self.decode_layer_fuser(dtype, kernels),
            self.experts_fuser(dtype, kernels),
        )

    def decode_layer_fuser(self, dtype: torch.dtype, kernels: str = "auto") -> DecodeLayerFuser | None:
        """A platform whose kernels can run a whole decoder layer of a decode step in one call returns the
        function that binds one to a layer's weights; None keeps the layer operator by operator."""
        return None

    def experts_fuser(self, dtype: torch.dtype, kernels: str = "auto") -> ExpertsFuser | None:
        """A platform that runs a mixture-of-experts layer's routed experts for a step in one call returns the
        function that binds one to a layer's experts; None runs them expert by expert (model/moe.py)."""
        return None

    def graph_capture(self) -> GraphCapture | None:
        """The device's API for recording kernels once and replaying them (graph_capture.py), where decode steps
        are to be replayed from graphs; None runs every step as it comes (the CPU, and devices whose graphs no one
        has checked yet)."""
        return None

    def get_attn_backend(self, ops: OperatorTable) -> AttentionBackend:
        """The attention backend the model runs with, over the operator table it was loaded with. The default is
        paged attention through that table's write_kv / decode_attention / prefill_attention; a device whose kernels
        take other metadata (block tables with sequence lengths, cumulative query offsets) returns its own."""
        return PagedAttentionBackend(ops)

    @classmethod
    def vendor_version(cls) -> str | None:
        """The installed version of the vendor's torch extension, read without importing it."""
        if cls.vendor_extension is None:
            return None
        try:
            return importlib.metadata.version(cls.vendor_extension)
        except importlib.metadata.PackageNotFoundError:
            return None

    def describe(self) -> dict[str, object]:
        info: dict[str, object] = {
            "platform": self.name,
            "device": str(self.device),
            "torch": torch.__version__,
            "dist_backend": self.dist_backend,
        }
        capture = self.graph_capture()
        info["graphs"] = capture.name if capture is not None else "none: every step runs eagerly"
        if self.vendor_extension is not None:
            info[self.vendor_extension] = self.vendor_version()
        return info
