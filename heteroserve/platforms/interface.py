"""The platform interface: every device-specific decision the engine needs, behind one class."""

from __future__ import annotations

import torch
import torch.nn.functional as F

DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}


class LinearOp:
    """y = x W^T + b. `prepare` runs once per weight at load time (e.g. to repack it for a kernel)."""

    name = "torch.linear"

    def prepare(self, weight: torch.Tensor) -> torch.Tensor:
        return weight

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return F.linear(x, weight, bias)


class Platform:
    """A device family. Subclasses override what differs; the engine never asks `if device == ...`."""

    name: str = "base"
    device_type: str = "cpu"
    dist_backend: str = "gloo"

    @classmethod
    def is_available(cls) -> bool:
        """Cheap detection: must not fail or be slow when the vendor's extension is absent."""
        raise NotImplementedError

    @property
    def device(self) -> torch.device:
        return torch.device(self.device_type)

    def supported_dtypes(self) -> list[torch.dtype]:
        """Dtypes this device computes fast; others are replaced by float32 under dtype='auto'."""
        return [torch.float32]

    def resolve_dtype(self, requested: str, checkpoint_dtype: torch.dtype) -> torch.dtype:
        if requested != "auto":
            dtype = DTYPES[requested]
            if dtype not in self.supported_dtypes():
                names = ", ".join(str(d).removeprefix("torch.") for d in self.supported_dtypes())
                raise ValueError(f"dtype {requested} is not supported on {self.name} (supported: {names})")
            return dtype
        return checkpoint_dtype if checkpoint_dtype in self.supported_dtypes() else torch.float32

    def linear_op(self, dtype: torch.dtype, kernels: str = "auto") -> LinearOp:
        """The matrix-product kernel for weights of this dtype; `kernels="reference"` asks for plain torch."""
        return LinearOp()

    def kv_cache_budget_bytes(self, requested: int | None) -> int:
        """Bytes for the KV block pool when the user gave none (or the user's figure, checked)."""
        raise NotImplementedError

    def configure_process(self) -> None:
        """Per-process setup such as thread counts; called once before the model loads."""

    def synchronize(self) -> None:
        """Waits for queued device work (for timing)."""

    def describe(self) -> dict[str, object]:
        return {"platform": self.name, "device": str(self.device), "torch": torch.__version__}
