"""Unified paged-attention Triton kernel over a flattened batch.

One launch serves decode tokens, prefill chunks and prefills after a prefix-cache hit.
Grid ``(T // BLOCK_Q + B, Hkv)``: a program takes one query tile (up to ``BLOCK_Q``
tokens of one sequence) and one KV head with its whole GQA group, streams the
sequence's context once through the block table up to the tile's causal bound (from
the tile's first window position with a sliding window), and writes the normalised
output. Tiling, masking, window and soft-cap are described in
:mod:`pagedserve.kernels._attention_common`.
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

__all__ = ["paged_attention_triton"]


@triton.jit
def _paged_attention_kernel(
    out_ptr,  # [T, Hq, D]
    query_ptr,  # [T, Hq, D]
    key_cache_ptr,  # [NB, BS, Hkv, D]
    value_cache_ptr,  # [NB, BS, Hkv, D]
    block_tables_ptr,  # [B, max_blocks]
    query_start_loc_ptr,  # [B + 1]
    seq_lens_ptr,  # [B]
    qk_scale,  # fp32: scale * log2(e)
    num_seqs,
    stride_q_tok,
    stride_q_head,
    stride_o_tok,
    stride_o_head,
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
    # The tile's last token sees context positions < context_len + min(tile end, q_len);
    # with a window, none sees a key before its first token's window (nothing before
    # kv_start is read).
    kv_end = context_len + tl.minimum(q_tile_start + BLOCK_Q, q_len)
    first_q_pos = context_len + q_tile_start
    kv_start = window_kv_start(first_q_pos, SLIDING_WINDOW, TILE_N)
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
        kv_start,
        kv_end,
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
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # rows that saw no key -> 0
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    ptrs = out_ptr + q_tok[:, None] * stride_o_tok + q_head[:, None] * stride_o_head
    mask = row_mask[:, None] & (offs_d < HEAD_DIM)[None, :]
    tl.store(ptrs + offs_d[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)


def paged_attention_triton(
    query: Tensor,  # [T, Hq, D]
    key_cache: Tensor,  # [NB, BS, Hkv, D]
    value_cache: Tensor,  # [NB, BS, Hkv, D]
    block_tables: Tensor,  # [B, max_blocks] int32
    query_start_loc: Tensor,  # [B + 1] int32
    seq_lens: Tensor,  # [B] int32
    scale: float,
    *,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> Tensor:  # [T, Hq, D]
    """Unified paged attention; contract of :func:`pagedserve.kernels.reference.paged_attention`.

    ``max_query_len`` picks decode tiles when it is 1 (``None``: prefill tiles, correct
    for any batch). ``max_seq_len`` is unused: each program reads its own ``seq_lens``.
    The output is zero-initialised, so rows past ``qsl[B]`` are zeros.
    ``sliding_window`` and ``logits_soft_cap`` (``None`` / 0: off) are compile-time
    constants of the kernel: each distinct value compiles its own variant, and off
    compiles the full-attention kernel unchanged.
    """
    del max_seq_len
    dims = check_attention_inputs(
        query, key_cache, value_cache, block_tables, query_start_loc, seq_lens
    )
    window, soft_cap = check_window_and_soft_cap(sliding_window, logits_soft_cap)
    out = torch.zeros_like(query, memory_format=torch.contiguous_format)
    if dims.num_tokens == 0 or dims.num_seqs == 0:
        return out
    cfg = tile_config(dims, max_query_len, query.dtype)
    grid = (cfg.num_q_tiles_bound(dims), dims.num_kv_heads)
    _paged_attention_kernel[grid](
        out,
        query,
        key_cache,
        value_cache,
        block_tables,
        query_start_loc,
        seq_lens,
        scale * LOG2E,
        dims.num_seqs,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
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
    return out
