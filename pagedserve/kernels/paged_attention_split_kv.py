"""Split-KV ("flash-decoding") paged attention: for a few long sequences.

A decode batch of ``B`` sequences gives the unified kernel only ``B * Hkv`` programs,
too few to fill the GPU when ``B`` is small. Here the context of each sequence is also
cut into ``num_splits`` contiguous ranges of ``split_len`` positions (a multiple of
``TILE_N``; with a sliding window, only the span of each query tile's window is cut):

1. ``_split_kv_kernel``, grid ``(T // BLOCK_Q + B, Hkv, num_splits)``: same query tiles
   as the unified kernel, but each program attends only to its range and writes an fp32
   partial output, normalised by its own softmax sum, and the range's log2-sum-exp2
   (``-inf`` where the row saw no key in the range);
2. ``_merge_kernel``, grid ``(T, Hq)``: ``out = sum_s 2^(lse_s - M) o_s / sum_s
   2^(lse_s - M)`` with ``M = max_s lse_s``; a row with no key anywhere, or a padding
   row past ``qsl[B]``, is written as zeros.

The kernel is exact for any batch (prefill rows too), but its partial buffers are
``num_splits * T * Hq * D`` fp32, so dispatch uses it for decode batches only
(:func:`pagedserve.kernels.ops.split_kv_heuristic`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from pagedserve.kernels._attention_common import (
    LOG2E,
    attend_range,
    check_attention_inputs,
    dot_precision,
    load_q_tile,
    locate_tile,
    tile_config,
    window_kv_start,
)
from pagedserve.kernels.kv_quant import is_int8_records
from pagedserve.kernels.reference import check_window_and_soft_cap

__all__ = ["paged_attention_split_kv_triton"]

MAX_SPLITS = 256


@triton.jit
def _split_kv_kernel(
    partial_out_ptr,  # [S, T, Hq, D] fp32
    partial_lse_ptr,  # [S, T, Hq] fp32, log2 domain
    query_ptr,  # [T, Hq, D]
    key_cache_ptr,  # [NB, BS, Hkv, D]
    value_cache_ptr,  # [NB, BS, Hkv, D]
    block_tables_ptr,  # [B, max_blocks]
    query_start_loc_ptr,  # [B + 1]
    seq_lens_ptr,  # [B]
    qk_scale,  # fp32: scale * log2(e)
    num_seqs,
    split_len,  # context positions per split, a multiple of TILE_N
    stride_q_tok,
    stride_q_head,
    stride_po_split,
    stride_po_tok,
    stride_po_head,
    stride_pl_split,
    stride_pl_tok,
    stride_k_blk,
    stride_k_tok,
    stride_k_head,
    stride_v_blk,
    stride_v_tok,
    stride_v_head,
    stride_bt_seq,
    QUERIES_PER_KV: tl.constexpr,
    QUERIES_PER_KV_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    SLIDING_WINDOW: tl.constexpr,  # 0: full causal attention
    SOFT_CAP: tl.constexpr,  # 0.0: no capping
    KV_INT8: tl.constexpr,  # int8 records (kv_quant)
):
    tile_idx = tl.program_id(0)
    kv_head = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    seq_idx, q_begin, q_len, q_tile_start, context_len = locate_tile(
        query_start_loc_ptr, seq_lens_ptr, tile_idx, num_seqs, BLOCK_Q
    )
    if q_tile_start >= q_len:
        return  # spare program of the bounded grid
    q, q_tok, q_head, row_mask, q_pos = load_q_tile(
        query_ptr,
        q_begin,
        q_len,
        q_tile_start,
        context_len,
        kv_head,
        stride_q_tok,
        stride_q_head,
        QUERIES_PER_KV,
        QUERIES_PER_KV_PAD,
        BLOCK_M,
        HEAD_DIM,
        HEAD_DIM_PAD,
    )
    kv_end = context_len + tl.minimum(q_tile_start + BLOCK_Q, q_len)
    # The splits cut [kv_first, kv_end): the whole context, or with a window only the
    # span from the tile's first window tile, so every split can hold visible keys.
    first_q_pos = context_len + q_tile_start
    kv_first = window_kv_start(first_q_pos, SLIDING_WINDOW, TILE_N)
    kv_lo = kv_first + split * split_len
    kv_hi = tl.minimum(kv_lo + split_len, kv_end)  # empty range when kv_lo >= kv_end
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    block_table_ptr = block_tables_ptr + seq_idx.to(tl.int64) * stride_bt_seq
    acc, m_i, l_i = attend_range(
        q,
        acc,
        m_i,
        l_i,
        q_pos,
        key_cache_ptr,
        value_cache_ptr,
        block_table_ptr,
        kv_head,
        kv_lo,
        kv_hi,
        first_q_pos,
        qk_scale,
        stride_k_blk,
        stride_k_tok,
        stride_k_head,
        stride_v_blk,
        stride_v_tok,
        stride_v_head,
        BLOCK_SIZE,
        TILE_N,
        HEAD_DIM,
        HEAD_DIM_PAD,
        DOT_PRECISION,
        SLIDING_WINDOW,
        SOFT_CAP,
        KV_INT8,
    )
    seen = l_i > 0.0
    o = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(seen, m_i + tl.math.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
    split64 = split.to(tl.int64)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    o_ptrs = (
        partial_out_ptr
        + split64 * stride_po_split
        + q_tok[:, None] * stride_po_tok
        + q_head[:, None] * stride_po_head
        + offs_d[None, :]
    )
    tl.store(o_ptrs, o, mask=row_mask[:, None] & (offs_d < HEAD_DIM)[None, :])
    lse_ptrs = partial_lse_ptr + split64 * stride_pl_split + q_tok * stride_pl_tok + q_head
    tl.store(lse_ptrs, lse, mask=row_mask)


@triton.jit
def _merge_kernel(
    out_ptr,  # [T, Hq, D]
    partial_out_ptr,  # [S, T, Hq, D] fp32
    partial_lse_ptr,  # [S, T, Hq] fp32
    query_start_loc_ptr,  # [B + 1]
    num_seqs,
    num_splits,
    stride_o_tok,
    stride_o_head,
    stride_po_split,
    stride_po_tok,
    stride_po_head,
    stride_pl_split,
    stride_pl_tok,
    NUM_SPLITS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_mask = offs_d < HEAD_DIM
    out_ptrs = out_ptr + tok * stride_o_tok + head * stride_o_head + offs_d
    if tok >= tl.load(query_start_loc_ptr + num_seqs):
        # Batch padding row: no partials were written for it.
        tl.store(out_ptrs, tl.zeros([HEAD_DIM_PAD], dtype=out_ptr.dtype.element_ty), mask=d_mask)
        return
    offs_s = tl.arange(0, NUM_SPLITS_PAD)
    s_mask = offs_s < num_splits
    offs_s64 = offs_s.to(tl.int64)
    lse = tl.load(
        partial_lse_ptr + offs_s64 * stride_pl_split + tok * stride_pl_tok + head,
        mask=s_mask,
        other=float("-inf"),
    )  # [NUM_SPLITS_PAD]
    m = tl.max(lse, axis=0)
    w = tl.math.exp2(lse - tl.where(m == float("-inf"), 0.0, m))  # 0 for empty splits
    o = tl.load(
        partial_out_ptr
        + offs_s64[:, None] * stride_po_split
        + tok * stride_po_tok
        + head * stride_po_head
        + offs_d[None, :],
        mask=s_mask[:, None] & d_mask[None, :],
        other=0.0,
    )  # [NUM_SPLITS_PAD, HEAD_DIM_PAD]
    num = tl.sum(w[:, None] * o, axis=0)
    den = tl.sum(w, axis=0)
    out = num / tl.where(den > 0.0, den, 1.0)
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=d_mask)


def paged_attention_split_kv_triton(
    query: Tensor,  # [T, Hq, D]
    key_cache: Tensor,  # [NB, BS, Hkv, D]
    value_cache: Tensor,  # [NB, BS, Hkv, D]
    block_tables: Tensor,  # [B, max_blocks] int32
    query_start_loc: Tensor,  # [B + 1] int32
    seq_lens: Tensor,  # [B] int32
    scale: float,
    *,
    num_splits: int = 8,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> Tensor:  # [T, Hq, D]
    """Split-KV paged attention; contract of :func:`pagedserve.kernels.reference.paged_attention`.

    The context is cut into ``num_splits`` ranges of ``split_len = ceil(max_seq_len /
    num_splits)`` positions rounded up to the key tile; without the ``max_seq_len`` hint
    the block-table width ``max_blocks * block_size`` bounds it (no device sync).

    With ``sliding_window = W`` the splits cut only each query tile's window span,
    starting at its key-aligned window start: ``split_len = ceil(min(max_seq_len, W +
    BLOCK_Q + TILE_N - 2) / num_splits)`` rounded up to the key tile, so a long context
    does not leave most splits idle. A split that holds no key a row can see (past the
    context, or outside that row's window) gives that row the neutral partial
    ``lse = -inf`` with a zero output, which the merge weighs by 0.
    ``logits_soft_cap`` soft-caps the scores; both options are compile-time constants
    (``None`` / 0: off, the full-attention kernel unchanged).
    """
    dims = check_attention_inputs(
        query, key_cache, value_cache, block_tables, query_start_loc, seq_lens
    )
    window, soft_cap = check_window_and_soft_cap(sliding_window, logits_soft_cap)
    if not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"paged_attention: num_splits={num_splits} not in [1, {MAX_SPLITS}]")
    out = torch.empty_like(query, memory_format=torch.contiguous_format)
    if dims.num_tokens == 0 or dims.num_seqs == 0:
        return out.zero_()
    cfg = tile_config(dims, max_query_len, query.dtype)
    kv_bound = max_seq_len if max_seq_len is not None else dims.max_blocks_per_seq * dims.block_size
    if window:
        # A tile's keys lie in [window_kv_start, kv_end): at most the window, the tile's
        # other tokens and the key-tile alignment (see the kernel).
        kv_bound = min(kv_bound, window + cfg.block_q + cfg.tile_n - 2)
    split_len = triton.cdiv(triton.cdiv(max(kv_bound, 1), num_splits), cfg.tile_n) * cfg.tile_n
    partial_out = torch.empty(
        (num_splits, dims.num_tokens, dims.num_q_heads, dims.head_dim),
        dtype=torch.float32,
        device=query.device,
    )
    partial_lse = torch.empty(
        (num_splits, dims.num_tokens, dims.num_q_heads), dtype=torch.float32, device=query.device
    )
    grid = (cfg.num_q_tiles_bound(dims), dims.num_kv_heads, num_splits)
    _split_kv_kernel[grid](
        partial_out,
        partial_lse,
        query,
        key_cache,
        value_cache,
        block_tables,
        query_start_loc,
        seq_lens,
        scale * LOG2E,
        dims.num_seqs,
        split_len,
        query.stride(0),
        query.stride(1),
        partial_out.stride(0),
        partial_out.stride(1),
        partial_out.stride(2),
        partial_lse.stride(0),
        partial_lse.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        value_cache.stride(0),
        value_cache.stride(1),
        value_cache.stride(2),
        block_tables.stride(0),
        QUERIES_PER_KV=dims.queries_per_kv,
        QUERIES_PER_KV_PAD=cfg.queries_per_kv_pad,
        BLOCK_Q=cfg.block_q,
        BLOCK_M=cfg.block_m,
        BLOCK_SIZE=dims.block_size,
        TILE_N=cfg.tile_n,
        HEAD_DIM=dims.head_dim,
        HEAD_DIM_PAD=dims.head_dim_pad,
        DOT_PRECISION=dot_precision(query.dtype),
        SLIDING_WINDOW=window,
        SOFT_CAP=soft_cap,
        KV_INT8=is_int8_records(key_cache),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    _merge_kernel[(dims.num_tokens, dims.num_q_heads)](
        out,
        partial_out,
        partial_lse,
        query_start_loc,
        dims.num_seqs,
        num_splits,
        out.stride(0),
        out.stride(1),
        partial_out.stride(0),
        partial_out.stride(1),
        partial_out.stride(2),
        partial_lse.stride(0),
        partial_lse.stride(1),
        NUM_SPLITS_PAD=triton.next_power_of_2(num_splits),
        HEAD_DIM=dims.head_dim,
        HEAD_DIM_PAD=dims.head_dim_pad,
        num_warps=4 if dims.head_dim_pad >= 128 else 2,
    )
    return out
