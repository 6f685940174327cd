"""RMSNorm, fused with the residual add (``pagedserve.kernels.ops.fused_add_rms_norm``)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from pagedserve.kernels import ops

__all__ = ["RMSNorm"]


class RMSNorm(nn.Module):
    """RMSNorm with a learnt gain: ``w`` (Llama) or ``1 + w`` (``unit_offset``, Gemma, whose
    checkpoints store the offset from one)."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype, unit_offset: bool = False) -> None:
        super().__init__()
        self.eps, self.unit_offset = eps, unit_offset
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype))

    def forward(self, x: Tensor, residual: Tensor | None = None) -> Tensor:  # [T, H] -> [T, H]
        """RMSNorm of ``x``, or of ``x + residual`` with the sum stored into ``residual``."""
        return ops.fused_add_rms_norm(x, residual, self.weight, self.eps, self.unit_offset)
