"""Triton fused mixture of experts: grouped GEMMs over the tokens routed to each expert.

The contract is :func:`pagedserve.kernels.moe_reference.fused_moe_reference`'s. Three steps, as in
vLLM's ``fused_moe``, none of which reads a device value on the host (the launch sizes
depend on shapes alone, so a step could be captured in a CUDA graph):

1. :func:`moe_align_block_size` (torch): the ``N = T * k`` (token, slot) assignments,
   numbered ``t * k + s``, sorted by expert and each expert's run padded to a multiple of
   ``BLOCK_M`` with the sentinel ``N``; every ``BLOCK_M`` rows of the result belong to one
   expert, named by ``block_experts``.
2. ``_moe_gemm_kernel`` for ``x[t] @ w13[e]^T`` into ``[N, 2I]`` (one program per
   ``BLOCK_M x BLOCK_N`` tile: the block's rows gathered from ``x``, its expert's weights
   from the stacked ``w13``), then ``silu_and_mul`` into ``[N, I]``, then the kernel again
   for ``h @ w2[e]^T``, scaled by the routing weight, into ``[N, H]`` (rows in assignment
   order: row ``t * k + s``).
3. The sum over the ``k`` slots of each token (fp32 accumulation, one rounding).

Numerics differ from the reference only by rounding: the routing weight multiplies the
fp32 accumulator (one rounding where the reference rounds the product and the term), and
the slots are summed in fp32; within tolerance, not bit-identical (the CPU path is).

Padding rows are masked (never loaded, never stored); blocks past the used ones (the
capacity is a bound computed from shapes) exit at once. Accumulation is fp32; fp32 inputs
use exact fp32 dots (``ieee``), not tf32. Addresses are 64-bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from pagedserve.kernels.moe_reference import check_moe_shapes
from pagedserve.kernels.silu_and_mul import silu_and_mul_triton

__all__ = ["MoEGemmConfig", "fused_moe_triton", "moe_align_block_size", "moe_gemm_config"]


@dataclass(frozen=True)
class MoEGemmConfig:
    """Tile sizes of the grouped GEMM; ``block_m`` is also the alignment of each expert's
    rows. ``group_m`` row blocks share a column sweep (an L2-friendly launch order)."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int = 1
    num_warps: int = 4
    num_stages: int = 3


def moe_gemm_config(num_assignments: int, num_experts: int) -> MoEGemmConfig:
    """Tiles for ``num_assignments = T * k`` routed rows over ``num_experts`` experts.

    Few rows per expert (at most 16 on average, decode): ``BLOCK_M = 16`` so that a block is
    mostly real rows, and long ``BLOCK_K`` to stream the weights, which dominate. Many rows
    (prefill): 64 x 64 tiles, 8 row blocks per launch group. Close to vLLM's untuned
    defaults for unquantised weights; not tuned on a GPU here.
    """
    if num_assignments <= 16 * num_experts:
        return MoEGemmConfig(block_m=16, block_n=64, block_k=64, group_m=1)
    return MoEGemmConfig(block_m=64, block_n=64, block_k=32, group_m=8, num_warps=4)


def moe_align_block_size(
    topk_ids: Tensor,  # [T, k] integer expert ids in [0, num_experts)
    num_experts: int,
    block_m: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """Sort the ``N = T * k`` assignments by expert, each expert's run padded to a multiple
    of ``block_m``.

    Returns ``(sorted_ids, block_experts, num_padded)``:

    - ``sorted_ids`` ``[P]`` int32: assignment numbers ``t * k + s``, grouped by expert in
      increasing expert order, increasing within an expert; padding is ``N``. ``P`` is a
      multiple of ``block_m`` bounding the padded total from shapes alone:
      ``min(N + E * (block_m - 1), N * block_m)`` rounded up.
    - ``block_experts`` ``[P / block_m]`` int32: the expert of each block; ``-1`` for the
      blocks past the used ones.
    - ``num_padded`` ``[1]`` int32: the rows in use (the sum of the padded runs).

    No host sync: every size comes from shapes.
    """
    device = topk_ids.device
    flat = topk_ids.reshape(-1).to(torch.int64)
    n = flat.numel()
    capacity = min(n + num_experts * (block_m - 1), n * block_m)
    capacity = triton.cdiv(capacity, block_m) * block_m
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)  # [E]: end of each expert's padded run
    order = torch.argsort(flat, stable=True)  # assignments by expert, in order within one
    sorted_experts = flat[order]
    first_sorted = counts.cumsum(0) - counts  # where each expert's run starts in `order`
    rank = torch.arange(n, device=device) - first_sorted[sorted_experts]
    dest = (padded_end - padded)[sorted_experts] + rank
    sorted_ids = torch.full((capacity,), n, dtype=torch.int32, device=device)
    sorted_ids.scatter_(0, dest, order.to(torch.int32))
    block_start = torch.arange(0, capacity, block_m, device=device)
    block_experts = torch.searchsorted(padded_end, block_start, right=True)
    block_experts = torch.where(block_experts < num_experts, block_experts, -1)
    num_padded = padded_end[-1:].to(torch.int32)
    return sorted_ids, block_experts.to(torch.int32), num_padded


@triton.jit
def _moe_gemm_kernel(
    a_ptr,  # [M_a, K]: x (rows t = assignment // ROWS_PER_A) or h (row = assignment)
    b_ptr,  # [E, N, K]: stacked expert weights
    c_ptr,  # [num_valid, N]: row = assignment number
    weights_ptr,  # [num_valid] routing weights (read when MUL_WEIGHT)
    sorted_ids_ptr,  # [P] int32
    block_experts_ptr,  # [P / BLOCK_M] int32
    num_padded_ptr,  # [1] int32
    N,
    K,
    P,
    num_valid,
    stride_am,
    stride_ak,
    stride_be,
    stride_bn,
    stride_bk,
    stride_cm,
    stride_cn,
    ROWS_PER_A: tl.constexpr,
    MUL_WEIGHT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(P, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    # Grouped launch order: GROUP_M row blocks sweep the columns together.
    per_group = GROUP_M * num_pid_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = min(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    expert = tl.load(block_experts_ptr + pid_m).to(tl.int64)
    if expert < 0:
        return
    ids = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_mask = ids < num_valid
    rows = ids.to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + (rows // ROWS_PER_A)[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = (
        b_ptr
        + expert * stride_be
        + offs_n.to(tl.int64)[None, :] * stride_bn
        + offs_k[:, None] * stride_bk
    )
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = offs_k < K - k0
        a = tl.load(a_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    if MUL_WEIGHT:
        w = tl.load(weights_ptr + rows, mask=row_mask, other=0.0)
        acc = acc * w.to(tl.float32)[:, None]
    c_ptrs = c_ptr + rows[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_mask[:, None] & n_mask[None, :])


def _moe_gemm(
    a: Tensor,
    b: Tensor,
    out: Tensor,
    weights: Tensor | None,
    align: tuple[Tensor, Tensor, Tensor],
    rows_per_a: int,
    cfg: MoEGemmConfig,
) -> None:
    """``out[r] = a[r // rows_per_a] @ b[expert(r)]^T`` (times ``weights[r]``) for every
    assignment ``r`` of ``align``."""
    sorted_ids, block_experts, num_padded = align
    n, k = b.shape[1], b.shape[2]
    p = sorted_ids.shape[0]
    grid = (triton.cdiv(p, cfg.block_m) * triton.cdiv(n, cfg.block_n),)
    _moe_gemm_kernel[grid](
        a,
        b,
        out,
        weights if weights is not None else out,
        sorted_ids,
        block_experts,
        num_padded,
        n,
        k,
        p,
        out.shape[0],
        a.stride(0),
        a.stride(1),
        b.stride(0),
        b.stride(1),
        b.stride(2),
        out.stride(0),
        out.stride(1),
        ROWS_PER_A=rows_per_a,
        MUL_WEIGHT=weights is not None,
        DOT_PRECISION="ieee" if a.dtype == torch.float32 else None,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        GROUP_M=cfg.group_m,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )


def fused_moe_triton(
    x: Tensor,  # [T, H]
    topk_weights: Tensor,  # [T, k] float
    topk_ids: Tensor,  # [T, k] integer
    w13: Tensor,  # [E, 2I, H]
    w2: Tensor,  # [E, H, I]
    config: MoEGemmConfig | None = None,
) -> Tensor:  # [T, H]
    """Triton ``fused_moe``; contract of :func:`.moe_reference.fused_moe_reference`.
    ``config`` overrides the tiles of :func:`moe_gemm_config` (tests use it)."""
    check_moe_shapes(x, topk_weights, topk_ids, w13, w2)
    num_tokens, top_k = topk_ids.shape
    num_experts, hidden = w13.shape[0], x.shape[1]
    n = num_tokens * top_k
    if n == 0:
        return x.new_zeros(num_tokens, hidden)
    cfg = config or moe_gemm_config(n, num_experts)
    align = moe_align_block_size(topk_ids, num_experts, cfg.block_m)
    gate_up = x.new_empty(n, w13.shape[1])  # [N, 2I], row t * k + s
    _moe_gemm(x, w13, gate_up, None, align, top_k, cfg)
    h = silu_and_mul_triton(gate_up)  # [N, I]
    down = x.new_empty(n, hidden)  # [N, H], scaled by the routing weights
    _moe_gemm(h, w2, down, topk_weights.reshape(-1), align, 1, cfg)
    return down.view(num_tokens, top_k, hidden).sum(dim=1, dtype=torch.float32).to(x.dtype)
