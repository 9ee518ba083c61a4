"""The simulated device's heteroserve platform: what a vendor writes for a new accelerator, at its smallest.

Everything the engine needs comes from the `Platform` defaults, which suit any device torch exposes as
`torch.<device_type>`: memory from `torch.sim.mem_get_info`, the plain-torch reference operators on the device,
paged attention through them. A vendor's platform overrides what its hardware does better (operator kernels,
an attention backend, a weight packer); this one overrides only what describes the device.
"""

from __future__ import annotations

import torch

from heteroserve.platforms.interface import Platform


class SimulatedPlatform(Platform):
    name = "sim"
    device_type = "sim"
    dist_backend = "gloo"  # no collective library of its own: gloo over host copies
    collectives_through_host = True
    ray_resource = "CPU"

    @classmethod
    def is_available(cls) -> bool:
        from heteroserve_simulated_device.device import load

        load()
        return True

    def supported_dtypes(self) -> list[torch.dtype]:
        return [torch.float32, torch.bfloat16, torch.float16]

    def describe(self) -> dict[str, object]:
        return {**super().describe(), "sim": torch.sim.get_device_name()}
