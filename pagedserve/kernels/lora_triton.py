"""Triton multi-LoRA kernels (Punica's shrink and expand, grouped by adapter slot as in vLLM's
v1 LoRA kernels): ``y[t] += (x[t] @ A[slot[t]].T) @ B[slot[t]].T`` for a batch whose rows
use different adapters of one slot table.

The contracts are :func:`pagedserve.kernels.lora_reference.lora_shrink_ref` and
:func:`.lora_reference.lora_expand_ref`. Two steps, neither reading a device value on the
host (every launch size comes from shapes: ``T``, ``S``, ``R``, ``K``/``N`` and the tiles),
so a whole LoRA layer can be captured in a CUDA graph and replayed with other slots:

1. :func:`lora_token_groups` (torch): a stable argsort of the rows by slot (rows with slot
   ``-1`` sorted last, past every slot), the rows of each slot and where its run starts.
   It depends on ``token_slots`` alone: a model computes it once per step and passes it
   (``groups=``) to every LoRA layer's shrink and expand.
2. One launch per op, grid ``(cdiv(T, BLOCK_M) * cdiv(cols, BLOCK_N), [SPLIT_K,] S)``:
   program ``(i, [k,] slot)`` takes the ``i``-th tile of ``BLOCK_M`` rows of that slot's run
   times a ``BLOCK_N`` tile of the output columns, and returns at once when the tile starts
   past the slot's row count (a slot no row uses costs empty programs only). Rows with slot
   ``-1`` belong to no slot's run, so no program reads or writes them.

   - shrink, ``_lora_shrink_kernel``: ``out[rows] = x[rows] @ a[slot].T`` into a zeroed fp32
     ``[T, R]``; ``K`` is reduced in ``BLOCK_K`` steps, split over ``SPLIT_K`` programs that
     add their partial sums atomically (decode: few row tiles, a long ``K``); with
     ``SPLIT_K = 1`` each output element has one writer and the result is deterministic.
   - expand, ``_lora_expand_kernel``: ``y[rows] = to_dtype(y[rows] + s[rows] @ b[slot].T)``
     in place (one rounding), ``R`` reduced in ``BLOCK_K`` steps; each output element has
     one writer.

Accumulation is fp32. Shrink multiplies in the input dtype (exact fp32 ``ieee`` dots for
fp32); expand multiplies in fp32 (``s`` is fp32; ``b`` is widened; ``tf32`` dots for
half-precision ``b``, ``ieee`` for fp32). ``tl.dot`` needs every tile side >= 16, so a rank
of 8 is padded to a 16-wide tile with masked (zero) lanes, as are ``K`` and ``N`` past the
last full tile. Addresses are 64-bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from pagedserve.kernels.lora_reference import check_lora_expand_shapes, check_lora_shrink_shapes

__all__ = [
    "LoRAKernelConfig",
    "LoRATokenGroups",
    "lora_expand_config",
    "lora_expand_triton",
    "lora_shrink_config",
    "lora_shrink_triton",
    "lora_token_groups",
]

_DECODE_TOKENS = 128  # up to this many rows: decode-sized tiles (and split-K for shrink)


@dataclass(frozen=True)
class LoRAKernelConfig:
    """Tiles of one LoRA launch: ``block_m`` rows of one slot x ``block_n`` output columns
    (``R`` for shrink, ``N`` for expand), the reduction (``K`` for shrink, ``R`` for expand)
    in ``block_k`` steps; shrink splits it over ``split_k`` programs (expand ignores it).
    Every block is a power of two >= 16 (``tl.dot``)."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"LoRAKernelConfig.{name} = {value}: need a power of two >= 16")
        if self.split_k < 1:
            raise ValueError(f"LoRAKernelConfig.split_k = {self.split_k}: need >= 1")


def _rank_block(rank: int) -> int:
    return max(16, min(64, triton.next_power_of_2(rank)))


def lora_shrink_config(num_tokens: int, rank: int, k: int) -> LoRAKernelConfig:
    """Tiles for shrinking ``num_tokens`` rows of width ``k`` to rank ``rank``.

    Decode-sized batches (at most 128 rows): 16-row tiles, since a slot rarely has more
    rows, and ``K`` split over up to 8 programs in 128-wide steps (the output is a
    ``rank``-wide sliver, so without the split one program per slot would stream a whole
    ``a[slot]``). Larger batches: 64-row tiles, 64-wide ``K`` steps, no split. Not tuned
    on a GPU here.
    """
    block_n = _rank_block(rank)
    if num_tokens <= _DECODE_TOKENS:
        return LoRAKernelConfig(16, block_n, 128, split_k=max(1, min(8, triton.cdiv(k, 128))))
    return LoRAKernelConfig(64, block_n, 64)


def lora_expand_config(num_tokens: int, n: int, rank: int) -> LoRAKernelConfig:
    """Tiles for expanding ``num_tokens`` rows from rank ``rank`` to width ``n``: 16 x 128
    tiles for decode-sized batches (at most 128 rows), 64 x 64 otherwise; the rank in one
    step up to 64. Not tuned on a GPU here."""
    del n  # the tiles do not depend on it yet; kept so that callers need not change
    block_k = _rank_block(rank)
    if num_tokens <= _DECODE_TOKENS:
        return LoRAKernelConfig(16, 128, block_k)
    return LoRAKernelConfig(64, 64, block_k)


@dataclass(frozen=True)
class LoRATokenGroups:
    """The rows of a batch grouped by adapter slot (:func:`lora_token_groups`).

    - ``sorted_ids`` ``[T]`` int32: row numbers sorted by slot, stably (increasing within a
      slot); rows with slot ``-1`` come last.
    - ``counts`` ``[S]`` int32: the rows of each slot.
    - ``starts`` ``[S]`` int32: where each slot's run starts in ``sorted_ids``.
    """

    sorted_ids: Tensor
    counts: Tensor
    starts: Tensor


def lora_token_groups(token_slots: Tensor, num_slots: int) -> LoRATokenGroups:
    """Group the rows of ``token_slots`` (``[T]`` int in ``[-1, num_slots)``; any negative
    value means no adapter) by slot, on the device of ``token_slots``, with no host sync."""
    slots = token_slots.to(torch.int64)
    keys = torch.where(slots < 0, num_slots, slots)  # no adapter: one bucket past the slots
    counts = torch.zeros(num_slots + 1, dtype=torch.int64, device=slots.device)
    counts.scatter_add_(0, keys, torch.ones_like(keys))
    starts = counts.cumsum(0) - counts
    order = torch.argsort(keys, stable=True)
    return LoRATokenGroups(
        sorted_ids=order.to(torch.int32),
        counts=counts[:num_slots].to(torch.int32),
        starts=starts[:num_slots].to(torch.int32),
    )


@triton.jit
def _tile(pid, N, BLOCK_N: tl.constexpr):
    """A program's (row tile, column tile) of its slot's run."""
    num_pid_n = tl.cdiv(N, BLOCK_N)
    return pid // num_pid_n, pid % num_pid_n


@triton.jit
def _slot_rows(sorted_ids_ptr, starts_ptr, slot, count, pid_m, BLOCK_M: tl.constexpr):
    """The token rows of row tile ``pid_m`` of ``slot``'s run, and which of them exist."""
    start = tl.load(starts_ptr + slot)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = offs_m < count
    rows = tl.load(sorted_ids_ptr + start + offs_m, mask=row_mask, other=0).to(tl.int64)
    return rows, row_mask


@triton.jit
def _lora_shrink_kernel(
    x_ptr,  # [T, K]
    a_ptr,  # [S, R, K]
    out_ptr,  # [T, R] fp32, zeroed
    sorted_ids_ptr,  # [T] int32
    counts_ptr,  # [S] int32
    starts_ptr,  # [S] int32
    R,
    K,
    stride_xm,
    stride_xk,
    stride_as,
    stride_ar,
    stride_ak,
    stride_om,
    stride_or,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
):
    pid_k = tl.program_id(1)
    slot = tl.program_id(2)
    pid_m, pid_n = _tile(tl.program_id(0), R, BLOCK_N)
    count = tl.load(counts_ptr + slot)
    if pid_m * BLOCK_M >= count:
        return
    rows, row_mask = _slot_rows(sorted_ids_ptr, starts_ptr, slot, count, pid_m, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < R
    offs_k = tl.arange(0, BLOCK_K)
    first_k = pid_k * BLOCK_K
    x_ptrs = x_ptr + rows[:, None] * stride_xm + (first_k + offs_k)[None, :] * stride_xk
    a_ptrs = (
        a_ptr
        + slot.to(tl.int64) * stride_as
        + offs_n.to(tl.int64)[None, :] * stride_ar
        + (first_k + offs_k)[:, None] * stride_ak
    )
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(first_k, K, BLOCK_K * SPLIT_K):
        k_mask = offs_k < K - k0
        x = tl.load(x_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        a = tl.load(a_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        acc = tl.dot(x, a, acc, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K * SPLIT_K * stride_xk
        a_ptrs += BLOCK_K * SPLIT_K * stride_ak
    out_ptrs = out_ptr + rows[:, None] * stride_om + offs_n[None, :] * stride_or
    out_mask = row_mask[:, None] & n_mask[None, :]
    if SPLIT_K == 1:
        tl.store(out_ptrs, acc, mask=out_mask)
    else:
        tl.atomic_add(out_ptrs, acc, mask=out_mask, sem="relaxed")


@triton.jit
def _lora_expand_kernel(
    s_ptr,  # [T, R] fp32
    b_ptr,  # [S, N, R]
    y_ptr,  # [T, N], updated in place
    sorted_ids_ptr,  # [T] int32
    counts_ptr,  # [S] int32
    starts_ptr,  # [S] int32
    N,
    R,
    stride_sm,
    stride_sr,
    stride_bs,
    stride_bn,
    stride_br,
    stride_ym,
    stride_yn,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    slot = tl.program_id(1)
    pid_m, pid_n = _tile(tl.program_id(0), N, BLOCK_N)
    count = tl.load(counts_ptr + slot)
    if pid_m * BLOCK_M >= count:
        return
    rows, row_mask = _slot_rows(sorted_ids_ptr, starts_ptr, slot, count, pid_m, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    s_ptrs = s_ptr + rows[:, None] * stride_sm + offs_k[None, :] * stride_sr
    b_ptrs = (
        b_ptr
        + slot.to(tl.int64) * stride_bs
        + offs_n.to(tl.int64)[None, :] * stride_bn
        + offs_k[:, None] * stride_br
    )
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, R, BLOCK_K):
        k_mask = offs_k < R - k0
        s = tl.load(s_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        acc = tl.dot(s, b.to(tl.float32), acc, input_precision=DOT_PRECISION)
        s_ptrs += BLOCK_K * stride_sr
        b_ptrs += BLOCK_K * stride_br
    y_ptrs = y_ptr + rows[:, None] * stride_ym + offs_n[None, :] * stride_yn
    y_mask = row_mask[:, None] & n_mask[None, :]
    y = tl.load(y_ptrs, mask=y_mask, other=0.0)
    tl.store(y_ptrs, (y.to(tl.float32) + acc).to(y_ptr.dtype.element_ty), mask=y_mask)


def lora_shrink_triton(
    x: Tensor,  # [T, K]
    a: Tensor,  # [S, R, K]
    token_slots: Tensor,  # [T] int, in [-1, S)
    *,
    groups: LoRATokenGroups | None = None,
    config: LoRAKernelConfig | None = None,
) -> Tensor:  # [T, R] fp32
    """Triton ``lora_shrink``; contract of :func:`.lora_reference.lora_shrink_ref`.

    ``groups`` is :func:`lora_token_groups` of ``token_slots`` when the caller already has
    it (shared by the layers of a step); ``config`` overrides the tiles of
    :func:`lora_shrink_config` (tests use it). The ``split_k > 1`` path adds fp32 partial
    sums atomically: the result is then exact up to the order of those additions.
    """
    check_lora_shrink_shapes(x, a, token_slots)
    num_tokens, k = x.shape
    num_slots, rank = a.shape[0], a.shape[1]
    out = torch.zeros(num_tokens, rank, dtype=torch.float32, device=x.device)
    if num_tokens == 0 or num_slots == 0 or rank == 0 or k == 0:
        return out
    cfg = config or lora_shrink_config(num_tokens, rank, k)
    split_k = max(1, min(cfg.split_k, triton.cdiv(k, cfg.block_k)))
    grp = groups if groups is not None else lora_token_groups(token_slots, num_slots)
    grid = (
        triton.cdiv(num_tokens, cfg.block_m) * triton.cdiv(rank, cfg.block_n),
        split_k,
        num_slots,
    )
    _lora_shrink_kernel[grid](
        x,
        a,
        out,
        grp.sorted_ids,
        grp.counts,
        grp.starts,
        rank,
        k,
        x.stride(0),
        x.stride(1),
        a.stride(0),
        a.stride(1),
        a.stride(2),
        out.stride(0),
        out.stride(1),
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else None,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        SPLIT_K=split_k,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return out


def lora_expand_triton(
    s: Tensor,  # [T, R] fp32
    b: Tensor,  # [S, N, R]
    token_slots: Tensor,  # [T] int, in [-1, S)
    y: Tensor,  # [T, N], updated in place
    *,
    groups: LoRATokenGroups | None = None,
    config: LoRAKernelConfig | None = None,
) -> None:
    """Triton ``lora_expand``; contract of :func:`.lora_reference.lora_expand_ref`.
    ``groups`` and ``config`` as for :func:`lora_shrink_triton` (``config.split_k`` is
    ignored: each output element has one writer)."""
    check_lora_expand_shapes(s, b, token_slots, y)
    num_tokens, rank = s.shape
    num_slots, n = b.shape[0], b.shape[1]
    if num_tokens == 0 or num_slots == 0 or rank == 0 or n == 0:
        return
    cfg = config or lora_expand_config(num_tokens, n, rank)
    grp = groups if groups is not None else lora_token_groups(token_slots, num_slots)
    grid = (triton.cdiv(num_tokens, cfg.block_m) * triton.cdiv(n, cfg.block_n), num_slots)
    _lora_expand_kernel[grid](
        s,
        b,
        y,
        grp.sorted_ids,
        grp.counts,
        grp.starts,
        n,
        rank,
        s.stride(0),
        s.stride(1),
        b.stride(0),
        b.stride(1),
        b.stride(2),
        y.stride(0),
        y.stride(1),
        DOT_PRECISION="ieee" if b.dtype == torch.float32 else "tf32",
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
