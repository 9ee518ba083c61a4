"""RMSNorm; the arithmetic is the platform's `rms_norm` operator (float32 like the reference models)."""

from __future__ import annotations

import torch
from torch import nn

from heteroserve.platforms.operators import OperatorTable


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, ops: OperatorTable) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)
        self.eps = eps
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.weight, self.eps)
