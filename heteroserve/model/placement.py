"""Putting a loaded model where the platform computes.

`nn.Module.to` moves parameters and buffers only; compressed weights (heteroserve.quantization) are plain
attributes, and a mixture of experts keeps its experts in lists. Placement moves all three, so nothing a step
reads stays on the host unless it is kept there on purpose: a module's `stays_on_host` names the attributes it
computes with on the CPU (a mixture of experts' routed experts under --moe-experts-device cpu).
"""

from __future__ import annotations

import torch
from torch import nn

from heteroserve.quantization.weight import CompressedWeight


def place_on(model: nn.Module, device: torch.device) -> None:
    """Every weight of `model` onto `device`, compressed and listed ones included, but those of the attributes a
    module names in `stays_on_host`."""
    moved: dict[int, nn.Parameter] = {}  # a parameter two modules share stays shared
    for module in model.modules():
        stays = getattr(module, "stays_on_host", frozenset())
        for name, param in module._parameters.items():
            if param is not None and name not in stays:
                module._parameters[name] = moved.setdefault(id(param), _moved(param, device))
        for name, buffer in module._buffers.items():
            if buffer is not None and name not in stays:
                module._buffers[name] = buffer.to(device)
        for name, value in list(vars(module).items()):
            if name in stays:
                continue
            if isinstance(value, CompressedWeight):
                setattr(module, name, value.to(device))
            elif isinstance(value, list) and any(_movable(v) for v in value):
                setattr(module, name, [_moved(v, device) for v in value])


def _movable(value: object) -> bool:
    return isinstance(value, (torch.Tensor, CompressedWeight))


def _moved(value: object, device: torch.device) -> object:
    if isinstance(value, nn.Parameter):
        return nn.Parameter(value.data.to(device), requires_grad=False)
    return value.to(device) if _movable(value) else value
