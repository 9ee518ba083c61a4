"""Parameters of the decoder's modules before loading: sized, uninitialised (the loader fills them), frozen."""

from __future__ import annotations

import torch
from torch import nn


def empty_weight(rows: int, cols: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(rows, cols), requires_grad=False)


def empty_vector(size: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(size), requires_grad=False)
