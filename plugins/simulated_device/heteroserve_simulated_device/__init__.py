"""heteroserve's simulated accelerator: a PrivateUse1 device backed by host memory, and its platform plugin.

The package is laid out as a vendor's plugin is: an entry point in the `heteroserve.platforms` group names
`register`, which answers the platform class's qualified name; the platform loads the device backend (here a
small C++ extension; for a vendor, `import torch_npu`) when heteroserve asks whether the device is available.
"""

from __future__ import annotations


def register() -> str:
    """The `heteroserve.platforms` entry point: cheap, imports neither torch nor the backend."""
    return "heteroserve_simulated_device.platform.SimulatedPlatform"
