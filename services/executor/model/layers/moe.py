"""Sparse mixture of experts (Mixtral, Qwen3-MoE): a router picks ``top_k`` of
``num_experts`` SwiGLU experts per token, whose outputs are summed with the router's weights.

Routing follows transformers: softmax of the router logits in fp32, top-k, optionally
renormalised to sum to 1, cast to the activations' dtype (Qwen3-MoE) or applied in fp32
(Mixtral, ``MoEConfig.fp32_weights``). The experts run in
:func:`pagedserve.kernels.ops.fused_moe` (Triton grouped GEMMs on CUDA, a loop over the hit experts
on the CPU that adds each token's terms in expert order, as transformers does).

Tensor parallelism cuts every expert as the dense MLP is cut: each rank holds a slice of
every expert's intermediate width (its gate rows and its up rows of ``w13``, the same
columns of ``w2``, zero-padded when the ranks do not divide the width), the router is
replicated (every rank routes the same all-reduced activations the same way), and the
partial sums are all-reduced. The Triton path reads nothing back on the host; whether a
step with experts is captured in a CUDA graph is decided elsewhere (``model/launch.py``).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from pagedserve.kernels import ops
from services.executor.model.config import MoEConfig
from services.executor.model.parallel import Comm, SingleComm

__all__ = ["SparseMoE", "route"]


def route(router_logits: Tensor, top_k: int, renormalize: bool) -> tuple[Tensor, Tensor]:
    """``(weights [T, k] fp32, expert ids [T, k])``: softmax in fp32, top-k (largest
    first), optionally divided by their sum (transformers' routing)."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)  # [T, E]
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts


class SparseMoE(nn.Module):
    """The router ``gate`` and every expert's projections stacked: ``w13`` ``[E, 2I, H]``
    (gate rows, then up rows) and ``w2`` ``[E, H, I]``, where ``I`` is ``moe``'s
    intermediate size, this rank's slice of it under tensor parallelism (see
    :meth:`ShardPlan.local_config`); the output is all-reduced over ``comm``."""

    def __init__(
        self,
        hidden_size: int,
        moe: MoEConfig,
        dtype: torch.dtype,
        comm: Comm | None = None,
    ) -> None:
        super().__init__()
        self.moe = moe
        self.comm: Comm = comm or SingleComm()
        e, inter = moe.num_experts, moe.intermediate_size
        self.gate = nn.Linear(hidden_size, e, bias=False, dtype=dtype)  # the router
        # Every expert's gate and up projections stacked, then its down projection.
        self.w13 = nn.Parameter(torch.empty(e, 2 * inter, hidden_size, dtype=dtype))
        self.w2 = nn.Parameter(torch.empty(e, hidden_size, inter, dtype=dtype))

    def forward(self, x: Tensor) -> Tensor:  # [T, H] -> [T, H]
        weights, experts = route(self.gate(x), self.moe.top_k, self.moe.renormalize)
        if not self.moe.fp32_weights:
            weights = weights.to(x.dtype)
        out = ops.fused_moe(x, weights, experts, self.w13, self.w2)
        return self.comm.all_reduce(out)
