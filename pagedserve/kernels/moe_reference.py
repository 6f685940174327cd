"""Torch reference of the fused mixture-of-experts op: the test oracle of the Triton kernel
(:mod:`pagedserve.kernels.fused_moe`) and of the CPU path (:mod:`pagedserve.kernels.cpu_moe`).

It is transformers' eager expert loop (``MixtralExperts.forward``): every expert in
increasing order runs on the tokens routed to it (ordered by slot, then by token, as
transformers' ``[E, k, T]`` expert mask gives them) and adds its weighted output into a
zeroed result.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from pagedserve.kernels.reference import silu_and_mul

__all__ = ["check_moe_shapes", "fused_moe_reference"]


def check_moe_shapes(
    x: Tensor, topk_weights: Tensor, topk_ids: Tensor, w13: Tensor, w2: Tensor
) -> None:
    """Raise ``ValueError`` unless the shapes fit the contract of
    :func:`fused_moe_reference`."""
    t, h = x.shape if x.dim() == 2 else (-1, -1)
    ok = (
        x.dim() == 2
        and topk_ids.dim() == 2
        and topk_ids.shape[0] == t
        and topk_weights.shape == topk_ids.shape
        and not topk_ids.is_floating_point()
        and topk_weights.is_floating_point()
        and w13.dim() == 3
        and w13.shape[1] % 2 == 0
        and w13.shape[2] == h
        and w2.shape == (w13.shape[0], h, w13.shape[1] // 2)
    )
    if not ok:
        raise ValueError(
            "fused_moe: expected x [T, H], topk_weights/topk_ids [T, k], w13 [E, 2I, H], "
            f"w2 [E, H, I]; got x {tuple(x.shape)}, topk_weights {tuple(topk_weights.shape)} "
            f"{topk_weights.dtype}, topk_ids {tuple(topk_ids.shape)} {topk_ids.dtype}, "
            f"w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)}"
        )


def fused_moe_reference(
    x: Tensor,  # [T, H]
    topk_weights: Tensor,  # [T, k] float
    topk_ids: Tensor,  # [T, k] integer, in [0, E)
    w13: Tensor,  # [E, 2I, H]: each expert's gate rows [0, I), then its up rows [I, 2I)
    w2: Tensor,  # [E, H, I]
) -> Tensor:  # [T, H]
    """A sparse mixture of SwiGLU experts over routing already chosen.

    Token ``t`` goes to experts ``topk_ids[t]`` (distinct, as top-k gives) with weights
    ``topk_weights[t]``; the result is, in ``x.dtype``::

        out[t] = sum_s  to_dtype(w2[e] @ silu_and_mul(w13[e] @ x[t]) * topk_weights[t, s])
                 with e = topk_ids[t, s]

    each product in the model dtype (the weight's multiplication by torch's type
    promotion, then rounded to ``x.dtype``), the terms added in increasing expert order
    into zeros (transformers' order). Under tensor parallelism ``w13`` and ``w2`` are one
    rank's slice of every expert's intermediate width and the result is a partial sum that
    the caller all-reduces.
    """
    check_moe_shapes(x, topk_weights, topk_ids, w13, w2)
    out = torch.zeros_like(x)
    for e in range(w13.shape[0]):
        slot, tokens = torch.where(topk_ids.t() == e)  # by slot, then token, as transformers
        if tokens.numel() == 0:
            continue
        h = silu_and_mul(F.linear(x[tokens], w13[e]))  # [n, I]
        y = F.linear(h, w2[e]) * topk_weights[tokens, slot, None]  # [n, H]
        out.index_add_(0, tokens, y.to(x.dtype))
    return out
