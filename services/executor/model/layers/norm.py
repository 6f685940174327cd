"""RMSNorm, fused with the residual add (``kernels.ops.fused_add_rms_norm``)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from kernels import ops

__all__ = ["RMSNorm"]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype))

    def forward(self, x: Tensor, residual: Tensor | None = None) -> Tensor:  # [T, H] -> [T, H]
        """RMSNorm of ``x``, or of ``x + residual`` with the sum stored into ``residual``."""
        return ops.fused_add_rms_norm(x, residual, self.weight, self.eps)
