"""Sparse mixture of experts (Mixtral, Qwen3-MoE): a router picks ``top_k`` of
``num_experts`` SwiGLU experts per token, whose outputs are summed with the router's weights.

Routing follows transformers: softmax of the router logits in fp32, top-k, optionally
renormalised to sum to 1, cast to the activations' dtype; each hit expert runs on its
tokens and its output, scaled by its weight, is added in expert order. One rank only (the
model refuses tensor parallelism of a mixture of experts), and not capturable as a CUDA
graph (the experts a step hits are read on the host).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from kernels import ops
from services.executor.model.config import MoEConfig

__all__ = ["SparseMoE"]


class SparseMoE(nn.Module):
    def __init__(self, hidden_size: int, moe: MoEConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.moe = moe
        e, inter = moe.num_experts, moe.intermediate_size
        self.gate = nn.Linear(hidden_size, e, bias=False, dtype=dtype)  # the router
        # Every expert's gate and up projections stacked, then its down projection.
        self.w13 = nn.Parameter(torch.empty(e, 2 * inter, hidden_size, dtype=dtype))
        self.w2 = nn.Parameter(torch.empty(e, hidden_size, inter, dtype=dtype))

    def forward(self, x: Tensor) -> Tensor:  # [T, H] -> [T, H]
        probs = torch.softmax(self.gate(x), dim=-1, dtype=torch.float32)  # [T, E]
        weights, experts = torch.topk(probs, self.moe.top_k, dim=-1)  # [T, k] each
        if self.moe.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(x.dtype)
        out = torch.zeros_like(x)
        for e in torch.unique(experts).tolist():  # ascending, as transformers adds them
            tokens, slot = torch.where(experts == e)
            h = ops.silu_and_mul(nn.functional.linear(x[tokens], self.w13[e]))  # [n, I]
            h = nn.functional.linear(h, self.w2[e]) * weights[tokens, slot, None]
            out.index_add_(0, tokens, h)
        return out
