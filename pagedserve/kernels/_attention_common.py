"""Pieces shared by the two paged-attention kernels: input checks, tile sizes, device code.

Tiling (both kernels). The flattened batch is cut into *query tiles*: ``BLOCK_Q``
consecutive query tokens of ONE sequence. A program handles one query tile and one KV
head, with all ``G = Hq // Hkv`` query heads of that KV head (its GQA group) stacked as
rows, so each K/V element it loads is used by the whole group::

    row m of the [BLOCK_M, D] Q tile  ->  token  m // G_PAD  of the tile,
                                          head   kv_head * G + m % G_PAD
    BLOCK_M = BLOCK_Q * G_PAD          (G_PAD = next power of two >= G; padded rows masked)

Program ``i`` of grid axis 0 finds its sequence by binary search over
``qsl[b] // BLOCK_Q + b`` (sequence ``b``'s first tile index), so the grid needs no host
data: ``T // BLOCK_Q + B`` programs always cover every tile; programs past a sequence's
last tile return at once.

Keys are visited ``TILE_N`` context positions at a time: each position's physical block
comes from the block table (int64 before it multiplies a stride), the scores are masked
to ``pos < kv_end`` and causally to ``pos <= row position``, and an online softmax in the
log2 domain (``exp2``, scale pre-multiplied by log2(e)) accumulates in fp32. A row that
saw no key ends with ``l == 0`` and is written as zeros, never NaN.

Sliding window and soft-cap are compile-time options (``SLIDING_WINDOW``, ``SOFT_CAP``;
0 = off, which compiles to exactly the full-attention code). With a window ``W`` the
key loop starts at the ``TILE_N``-aligned tile holding the first key of the tile's first
query's window (:func:`window_kv_start`): KV blocks wholly before every row's window
are never read; inside, scores are also masked to ``pos > row position - W`` and loads
below the tile's first window position are masked off. With a cap ``c`` the scores
become ``c * tanh(score / c)`` before the mask (:func:`soft_cap_log2`).

A cache in another dtype than the query's (:mod:`.kv_quant`): a narrower float (bf16, fp8)
is loaded and cast to the query's dtype; int8 records (``KV_INT8``) are loaded as codes, and
each position's fp32 scale multiplies its scores (K) and its probabilities (V), so the dots
run on the codes themselves (exact in any float dtype).

Head dims: any ``head_dim`` works; tiles are padded to the next power of two (>= 16, the
minimum ``tl.dot`` size) and the padding lanes are masked, so 64/128/256 run unpadded and
e.g. 80 or 96 run with masked lanes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from pagedserve.kernels.kv_quant import cache_head_dim

LOG2E = math.log2(math.e)
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)
#: Cache dtypes other than the query's that the kernels read (:mod:`.kv_quant`).
QUANTIZED_CACHE_DTYPES = (torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2, torch.int8)
MAX_HEAD_DIM = 256


@dataclass(frozen=True)
class AttentionDims:
    """Sizes of one paged-attention call, checked by :func:`check_attention_inputs`."""

    num_tokens: int  # T
    num_seqs: int  # B
    num_q_heads: int  # Hq
    num_kv_heads: int  # Hkv
    head_dim: int  # D
    block_size: int  # BS
    max_blocks_per_seq: int

    @property
    def queries_per_kv(self) -> int:
        return self.num_q_heads // self.num_kv_heads

    @property
    def head_dim_pad(self) -> int:
        return max(16, triton.next_power_of_2(self.head_dim))


@dataclass(frozen=True)
class TileConfig:
    """Compile-time tile sizes and launch options of an attention kernel."""

    block_q: int  # query tokens per program
    block_m: int  # rows per program = block_q * queries_per_kv_pad
    queries_per_kv_pad: int
    tile_n: int  # context positions per inner-loop step
    num_warps: int
    num_stages: int

    def num_q_tiles_bound(self, dims: AttentionDims) -> int:
        """Grid size that covers every query tile of any batch with these sizes."""
        return dims.num_tokens // self.block_q + dims.num_seqs


def _fail(msg: str) -> None:
    raise ValueError(f"paged_attention: {msg}")


def check_attention_inputs(
    query: Tensor,
    key_cache: Tensor,
    value_cache: Tensor,
    block_tables: Tensor,
    query_start_loc: Tensor,
    seq_lens: Tensor,
) -> AttentionDims:
    """Validate shapes, dtypes, devices and strides; raise ``ValueError`` naming the input."""
    if query.dim() != 3:
        _fail(f"query must be [T, Hq, D], got shape {tuple(query.shape)}")
    if key_cache.dim() != 4:
        _fail(f"key_cache must be [NB, BS, Hkv, D], got shape {tuple(key_cache.shape)}")
    if value_cache.shape != key_cache.shape:
        _fail(f"value_cache shape {tuple(value_cache.shape)} != key_cache {tuple(key_cache.shape)}")
    num_tokens, num_q_heads, head_dim = query.shape
    _, block_size, num_kv_heads, width = key_cache.shape
    if key_cache.dtype != query.dtype and key_cache.dtype not in QUANTIZED_CACHE_DTYPES:
        _fail(f"key_cache dtype {key_cache.dtype} is neither the query's nor a quantized one")
    if value_cache.dtype != key_cache.dtype:
        _fail(f"value_cache dtype {value_cache.dtype} != key_cache dtype {key_cache.dtype}")
    if width != cache_head_dim(head_dim, key_cache.dtype):
        _fail(f"head_dim mismatch: query {head_dim}, cache {width} ({key_cache.dtype})")
    if head_dim > MAX_HEAD_DIM:
        _fail(f"head_dim {head_dim} > {MAX_HEAD_DIM} is not supported")
    if num_kv_heads == 0 or num_q_heads % num_kv_heads != 0:
        _fail(f"num_q_heads={num_q_heads} must be a multiple of num_kv_heads={num_kv_heads}")
    if query.dtype not in SUPPORTED_DTYPES:
        _fail(f"query dtype {query.dtype} not in {SUPPORTED_DTYPES}")
    if block_tables.dim() != 2 or block_tables.dtype not in INDEX_DTYPES:
        _fail(
            f"block_tables must be [B, max_blocks] int32, got {block_tables.dtype} "
            f"{tuple(block_tables.shape)}"
        )
    num_seqs = block_tables.shape[0]
    if query_start_loc.shape != (num_seqs + 1,) or query_start_loc.dtype not in INDEX_DTYPES:
        _fail(
            f"query_start_loc must be [B + 1] = [{num_seqs + 1}] int32, got "
            f"{query_start_loc.dtype} {tuple(query_start_loc.shape)}"
        )
    if seq_lens.shape != (num_seqs,) or seq_lens.dtype not in INDEX_DTYPES:
        _fail(
            f"seq_lens must be [B] = [{num_seqs}] int32, got "
            f"{seq_lens.dtype} {tuple(seq_lens.shape)}"
        )
    tensors = {
        "query": query,
        "key_cache": key_cache,
        "value_cache": value_cache,
        "block_tables": block_tables,
        "query_start_loc": query_start_loc,
        "seq_lens": seq_lens,
    }
    for name, t in tensors.items():
        if t.device != query.device:
            _fail(f"{name} is on {t.device}, query on {query.device}")
    for name, t in (("query", query), ("key_cache", key_cache), ("value_cache", value_cache)):
        if t.stride(-1) != 1:
            _fail(f"{name} must be contiguous in head_dim (stride(-1) == 1), got {t.stride()}")
    if block_tables.stride(1) != 1:
        _fail(f"block_tables rows must be contiguous, got strides {block_tables.stride()}")
    for name, t in (("query_start_loc", query_start_loc), ("seq_lens", seq_lens)):
        if not t.is_contiguous():
            _fail(f"{name} must be contiguous")
    return AttentionDims(
        num_tokens=num_tokens,
        num_seqs=num_seqs,
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        max_blocks_per_seq=block_tables.shape[1],
    )


def tile_config(dims: AttentionDims, max_query_len: int | None, dtype: torch.dtype) -> TileConfig:
    """Tile sizes: small query tiles for decode, 64-128-row tiles for prefill.

    ``max_query_len is None`` (unknown without a device sync) takes the prefill tiles,
    which are correct for any batch. Key tiles shrink and pipeline stages drop for wide
    heads / fp32 so the K+V stages stay within ~96 KiB of shared memory.
    """
    g_pad = triton.next_power_of_2(dims.queries_per_kv)
    decode = max_query_len is not None and max_query_len <= 1
    # tl.dot needs M >= 16: for decode, fill the rows with the group (and spare tokens).
    rows = 16 if decode else (128 if dims.head_dim_pad <= 64 else 64)
    block_q = max(1, rows // g_pad)
    block_m = block_q * g_pad
    row_bytes = dims.head_dim_pad * dtype.itemsize
    tile_n = 64 if row_bytes <= 256 else 32
    stage_bytes = 2 * tile_n * row_bytes  # one K tile + one V tile
    num_stages = max(1, min(3 if decode else 2, (96 * 1024) // stage_bytes))
    num_warps = 8 if block_m * dims.head_dim_pad >= 64 * 128 else 4
    return TileConfig(block_q, block_m, g_pad, tile_n, num_warps, num_stages)


def dot_precision(dtype: torch.dtype) -> str | None:
    """fp32 inputs use exact fp32 dots (``ieee``), not tf32, to match the reference;
    16-bit inputs use the backend default (``None``)."""
    return "ieee" if dtype == torch.float32 else None


# ----------------------------------------------------------------------------- device code

_LOG2E_LITERAL: tl.constexpr = tl.constexpr(LOG2E)


@triton.jit
def window_kv_start(first_q_pos, SLIDING_WINDOW: tl.constexpr, TILE_N: tl.constexpr):
    """First context position a query tile's key loop visits (a multiple of ``TILE_N``).

    0 without a window; with one, the start of the key tile that holds the first key in
    the window of the tile's first (lowest-position) query, ``first_q_pos - W + 1``:
    every earlier key is outside every row's window.
    """
    if SLIDING_WINDOW > 0:
        return (tl.maximum(first_q_pos - SLIDING_WINDOW + 1, 0) // TILE_N) * TILE_N
    else:
        return 0


@triton.jit
def soft_cap_log2(s, SOFT_CAP: tl.constexpr):
    """Gemma 2's ``c * tanh(score / c)`` on log2-domain scores ``s = score * log2(e)``.

    ``tanh(x) = sign(x) * (1 - e) / (1 + e)`` with ``e = exp(-2|x|)`` in (0, 1]: no
    overflow for any ``x``, and exp2 is a fast hardware op (the interpreter has no tanh).
    """
    cap_log2: tl.constexpr = SOFT_CAP * _LOG2E_LITERAL
    x = s * (1.0 / cap_log2)  # score / c
    e = tl.math.exp2(tl.abs(x) * (-2.0 * _LOG2E_LITERAL))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0.0, -t, t) * cap_log2


@triton.jit
def find_seq_idx(query_start_loc_ptr, tile_idx, num_seqs, BLOCK_Q: tl.constexpr):
    """Largest b with qsl[b] // BLOCK_Q + b <= tile_idx (binary search over B + 1 entries)."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_tile = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_tile <= tile_idx:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def attend_range(
    q,  # [BLOCK_M, HEAD_DIM_PAD] query tile, cache dtype
    acc,  # [BLOCK_M, HEAD_DIM_PAD] fp32, unnormalised output
    m_i,  # [BLOCK_M] fp32 running max (log2 domain)
    l_i,  # [BLOCK_M] fp32 running sum of exp2
    q_pos,  # [BLOCK_M] int32 context position of each row
    key_cache_ptr,
    value_cache_ptr,
    block_table_ptr,  # this sequence's row of the block table
    kv_head,  # int64
    kv_start,  # first context position to visit (a multiple of TILE_N)
    kv_end,  # one past the last context position to visit
    first_q_pos,  # context position of the tile's first row (read with a window only)
    qk_scale,  # softmax scale * log2(e)
    stride_k_blk,
    stride_k_tok,
    stride_k_head,
    stride_v_blk,
    stride_v_tok,
    stride_v_head,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    SLIDING_WINDOW: tl.constexpr,  # 0: full causal attention
    SOFT_CAP: tl.constexpr,  # 0.0: no capping
    KV_INT8: tl.constexpr,  # the cache holds int8 records (codes, then an fp32 scale)
):
    """Online-softmax attention of a query tile over context positions [kv_start, kv_end).

    Each row sees positions ``<=`` its own ``q_pos`` and, with ``SLIDING_WINDOW = W``,
    ``> q_pos - W``; scores are soft-capped first when ``SOFT_CAP > 0``.
    """
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_mask = offs_d < HEAD_DIM
    if SLIDING_WINDOW > 0:
        # Keys before the first row's window are seen by no row: never loaded (the first
        # key tile may reach back into blocks the sequence no longer needs).
        kv_min = first_q_pos - SLIDING_WINDOW + 1
    for start in range(kv_start, kv_end, TILE_N):
        pos = start + tl.arange(0, TILE_N)  # [TILE_N] context positions
        n_mask = pos < kv_end
        if SLIDING_WINDOW > 0:
            n_mask = n_mask & (pos >= kv_min)
        phys = tl.load(block_table_ptr + pos // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        tok = (pos % BLOCK_SIZE).to(tl.int64)
        k_off = phys * stride_k_blk + tok * stride_k_tok + kv_head * stride_k_head  # [TILE_N]
        v_off = phys * stride_v_blk + tok * stride_v_tok + kv_head * stride_v_head  # [TILE_N]
        if HEAD_DIM == HEAD_DIM_PAD:
            kt_mask = n_mask[None, :]
            v_mask = n_mask[:, None]
        else:
            kt_mask = n_mask[None, :] & d_mask[:, None]
            v_mask = n_mask[:, None] & d_mask[None, :]
        # K loaded transposed: [HEAD_DIM_PAD, TILE_N].
        k_t = tl.load(key_cache_ptr + k_off[None, :] + offs_d[:, None], mask=kt_mask, other=0.0)
        s = tl.dot(q, k_t.to(q.dtype), input_precision=DOT_PRECISION)  # [BLOCK_M, TILE_N] fp32
        if KV_INT8:
            k_scale = tl.load(_scales(key_cache_ptr + k_off, HEAD_DIM), mask=n_mask, other=0.0)
            s = s * (k_scale * qk_scale)[None, :]
        else:
            s = s * qk_scale
        if SOFT_CAP > 0:
            s = soft_cap_log2(s, SOFT_CAP)
        visible = n_mask[None, :] & (pos[None, :] <= q_pos[:, None])
        if SLIDING_WINDOW > 0:
            visible = visible & (pos[None, :] > q_pos[:, None] - SLIDING_WINDOW)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # Rows that have seen no key keep m = -inf; subtract 0 instead so exp2 gives 0, not NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_safe[:, None])  # [BLOCK_M, TILE_N]
        alpha = tl.math.exp2(m_i - m_safe)  # [BLOCK_M]
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(value_cache_ptr + v_off[:, None] + offs_d[None, :], mask=v_mask, other=0.0)
        if KV_INT8:
            v_scale = tl.load(_scales(value_cache_ptr + v_off, HEAD_DIM), mask=n_mask, other=0.0)
            pv = (p * v_scale[None, :]).to(q.dtype)
        else:
            pv = p.to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(pv, v.to(q.dtype), input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _scales(record_ptrs, HEAD_DIM: tl.constexpr):
    """Pointers to the fp32 scales closing int8 records (byte pointers to their starts)."""
    return (record_ptrs + HEAD_DIM).to(tl.pointer_type(tl.float32))


@triton.jit
def locate_tile(
    query_start_loc_ptr,
    seq_lens_ptr,
    tile_idx,
    num_seqs,
    BLOCK_Q: tl.constexpr,
):
    """Map a query-tile program to (seq_idx, q_begin, q_len, q_tile_start, context_len).

    ``q_tile_start`` is the tile's first query token counted inside its sequence; the
    caller returns early when it is ``>= q_len`` (a spare program of the bounded grid).
    """
    seq_idx = find_seq_idx(query_start_loc_ptr, tile_idx, num_seqs, BLOCK_Q)
    seq_idx = tl.maximum(seq_idx, 0)
    q_begin = tl.load(query_start_loc_ptr + seq_idx)
    q_len = tl.load(query_start_loc_ptr + seq_idx + 1) - q_begin
    q_tile_start = (tile_idx - (q_begin // BLOCK_Q + seq_idx)) * BLOCK_Q
    context_len = tl.load(seq_lens_ptr + seq_idx) - q_len
    return seq_idx, q_begin, q_len, q_tile_start, context_len


@triton.jit
def load_q_tile(
    query_ptr,
    q_begin,
    q_len,
    q_tile_start,
    context_len,
    kv_head,
    stride_q_tok,
    stride_q_head,
    QUERIES_PER_KV: tl.constexpr,
    QUERIES_PER_KV_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
):
    """Load the [BLOCK_M, HEAD_DIM_PAD] Q tile (rows = tokens x group heads).

    Returns ``(q, q_tok, q_head, row_mask, q_pos)``: each row's flattened token index
    (int64), query head, validity and context position.
    """
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    q_in_seq = q_tile_start + offs_m // QUERIES_PER_KV_PAD  # [BLOCK_M]
    head_in_group = offs_m % QUERIES_PER_KV_PAD
    row_mask = (q_in_seq < q_len) & (head_in_group < QUERIES_PER_KV)
    q_tok = (q_begin + q_in_seq).to(tl.int64)
    q_head = (kv_head * QUERIES_PER_KV + head_in_group).to(tl.int64)
    mask = row_mask[:, None] & (offs_d < HEAD_DIM)[None, :]
    ptrs = query_ptr + q_tok[:, None] * stride_q_tok + q_head[:, None] * stride_q_head
    q = tl.load(ptrs + offs_d[None, :], mask=mask, other=0.0)
    q_pos = context_len + q_in_seq
    return q, q_tok, q_head, row_mask, q_pos
