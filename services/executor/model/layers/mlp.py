"""The gated MLP (SwiGLU, or GeGLU for Gemma), tensor-parallel: gate and up column-parallel,
down row-parallel."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from pagedserve.kernels import ops
from services.executor.model.config import ModelConfig
from services.executor.model.layers.linear import Linear
from services.executor.model.parallel import Comm

__all__ = ["MLP"]


class MLP(nn.Module):
    """``down(act(gate(x)) * up(x))``, ``act`` SiLU or tanh-GELU (``config.hidden_act``), with
    gate and up fused into one matmul, column-parallel, and ``down`` row-parallel, its partial
    sums all-reduced."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, comm: Comm) -> None:
        super().__init__()
        self.comm = comm
        self.intermediate_size = config.intermediate_size
        self.act_and_mul = (
            ops.gelu_tanh_and_mul if config.hidden_act == "gelu_tanh" else ops.silu_and_mul
        )
        self.gate_up_proj = Linear(
            config.hidden_size, 2 * config.intermediate_size, bias=config.mlp_bias, dtype=dtype
        )
        self.down_proj = Linear(
            config.intermediate_size, config.hidden_size, bias=config.mlp_bias, dtype=dtype
        )

    def forward(self, x: Tensor) -> Tensor:  # [T, H] -> [T, H]
        h = self.act_and_mul(self.gate_up_proj(x))  # [T, 2I] -> [T, I]
        return self.comm.all_reduce(self.down_proj(h))
