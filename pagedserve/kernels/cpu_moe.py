"""The mixture-of-experts op on the CPU: one sort of the routed rows by expert, one
contiguous slice per hit expert, one scatter back.

Contract of :func:`pagedserve.kernels.moe_reference.fused_moe_reference`, bit for bit on the same
BLAS and thread count: each expert multiplies the same rows in the same order as
transformers' loop does (its tokens by slot, then by token), and each token's terms are
added in increasing expert order.

Steps: the ``T * k`` (slot, token) rows are sorted by expert (one stable ``argsort``) and
the per-expert counts read once on the host; the rows of ``x`` are gathered once in that
order; each expert with rows runs its two matmuls on its contiguous slice, writing into
one ``[T * k, H]`` buffer; one ``index_copy_`` puts each row at (token, rank of its expert
among the token's), one multiply applies the routing weights, and the ``k`` terms are
added one by one. The loop is over the experts a step hits, never over tokens.

Measured (``bench.internals.moe_bench``, one thread, fp32): the matmuls dominate, so it is as
fast as the per-expert ``torch.where`` loop once experts see many tokens, and faster when
many experts see few (64 experts, top-8, one token: 0.84 ms against 1.23 ms). One
``index_add_`` of the weighted rows into zeros costs the same, but in fp16/bf16 it rounds
a token's sum once, not per term as transformers does. A ``bmm`` over every expert's rows
padded to the largest group is slower (3.0 ms against 0.6 ms at one token, 38 against
35 ms at 512 tokens; 8 experts, top-2, H 512, I 1024) and not bit-identical.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from pagedserve.kernels.moe_reference import check_moe_shapes
from pagedserve.kernels.reference import silu_and_mul

__all__ = ["fused_moe_cpu"]


def fused_moe_cpu(
    x: Tensor,  # [T, H]
    topk_weights: Tensor,  # [T, k] float
    topk_ids: Tensor,  # [T, k] integer, in [0, E)
    w13: Tensor,  # [E, 2I, H]
    w2: Tensor,  # [E, H, I]
) -> Tensor:  # [T, H]
    """CPU ``fused_moe``; contract of :func:`.moe_reference.fused_moe_reference`."""
    check_moe_shapes(x, topk_weights, topk_ids, w13, w2)
    num_tokens, top_k = topk_ids.shape
    hidden = x.shape[1]
    if num_tokens * top_k == 0:
        return x.new_zeros(num_tokens, hidden)
    num_rows = num_tokens * top_k
    # Rows numbered j = s * T + t (slot-major), stably sorted by expert: each expert's rows
    # in transformers' order (its expert mask is [E, k, T]), so that BLAS sees the same
    # matrices.
    order = torch.argsort(topk_ids.t().reshape(-1), stable=True)
    counts = torch.bincount(topk_ids.reshape(-1), minlength=w13.shape[0]).tolist()
    xs = x.index_select(0, order % num_tokens)  # [T * k, H]: the rows the experts multiply
    y = x.new_empty(num_rows, hidden)  # expert outputs, in `order`
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        rows = slice(start, start + n)
        h = silu_and_mul(F.linear(xs[rows], w13[e]))  # [n, I]
        torch.mm(h, w2[e].t(), out=y[rows])  # [n, H]
        start += n
    return _sum_in_expert_order(y, order, topk_weights, topk_ids, x.dtype)


def _sum_in_expert_order(
    y: Tensor,  # [T * k, H] expert outputs, row i from (slot, token) row order[i]
    order: Tensor,  # [T * k]
    topk_weights: Tensor,  # [T, k]
    topk_ids: Tensor,  # [T, k]
    dtype: torch.dtype,
) -> Tensor:  # [T, H]
    """Each token's weighted terms added one by one in increasing expert order into
    (implicit) zeros, one rounding per term: transformers' sum in every dtype."""
    num_tokens, top_k = topk_ids.shape
    # Row t * k + p: token t's term from the p-th smallest of its experts.
    experts_in_order = topk_ids.argsort(dim=-1, stable=True)  # [T, k]: slot of the p-th
    rank = torch.empty_like(experts_in_order)
    rank.scatter_(1, experts_in_order, torch.arange(top_k).expand(num_tokens, top_k))
    dest = (torch.arange(num_tokens)[:, None] * top_k + rank).t().reshape(-1)  # by j
    by_expert = torch.empty_like(y).index_copy_(0, dest[order], y)
    weights = topk_weights.gather(1, experts_in_order)
    terms = (by_expert.view(num_tokens, top_k, -1) * weights[..., None]).to(dtype)
    out = terms[:, 0].clone()  # = 0 + terms[:, 0]
    for p in range(1, top_k):
        out += terms[:, p]
    return out
