"""The simulated device's heteroserve platform: what a vendor writes for a new accelerator, at its smallest.

Everything the engine needs comes from the `Platform` defaults, which suit any device torch exposes as
`torch.<device_type>`: memory from `torch.sim.mem_get_info`, the plain-torch reference operators on the device,
paged attention through them. A vendor's platform overrides what its hardware does better (operator kernels,
an attention backend, a weight packer); this one overrides only what describes the device.

`HETEROSERVE_SIMULATED_UNSUPPORTED_OPERATORS=rms_norm,silu_and_mul` declares operators the device lacks, as
a vendor's platform does for kernels its hardware has not got: they run through the operator table's CPU
fallback and are counted (`heteroserve env`, the metrics).
"""

from __future__ import annotations

import os

import torch

from heteroserve.platforms.interface import Platform
from heteroserve.platforms.operators import OPERATORS

UNSUPPORTED_OPERATORS_VARIABLE = "HETEROSERVE_SIMULATED_UNSUPPORTED_OPERATORS"


class SimulatedPlatform(Platform):
    name = "sim"
    device_type = "sim"
    dist_backend = "gloo"  # no collective library of its own: gloo over host copies
    collectives_through_host = True
    ray_resource = "CPU"

    def __init__(self) -> None:
        super().__init__()
        names = [n.strip() for n in os.environ.get(UNSUPPORTED_OPERATORS_VARIABLE, "").split(",") if n.strip()]
        unknown = sorted(set(names) - set(OPERATORS))
        if unknown:
            raise ValueError(
                f"{UNSUPPORTED_OPERATORS_VARIABLE} names {', '.join(unknown)}, which are not operators "
                f"(operators: {', '.join(OPERATORS)})"
            )
        self.unsupported_operators = frozenset(names)

    @classmethod
    def is_available(cls) -> bool:
        from heteroserve_simulated_device.device import load

        load()
        return True

    def supported_dtypes(self) -> list[torch.dtype]:
        return [torch.float32, torch.bfloat16, torch.float16]

    def describe(self) -> dict[str, object]:
        return {**super().describe(), "sim": torch.sim.get_device_name()}
