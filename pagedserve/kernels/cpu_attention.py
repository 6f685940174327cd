"""Paged attention for the CPU, built for speed (``reference.py`` beside it stays the oracle).

Same contract as :func:`pagedserve.kernels.reference.paged_attention`. The batch is split by query
length:

- **decode rows** (one query token): sorted by context length and cut into a few buckets
  of similar length (:func:`decode_buckets`); each bucket in one batched computation per
  KV-head group: one gather of its rows' blocks (the bucket's longest context,
  block-aligned; with a sliding window, each row's own window: the few blocks that can hold
  it), a position mask, two batched matmuls and a softmax; grouped-query attention by
  viewing the query heads as ``[Hkv, group]``, never by repeating K/V;
- **short query rows** (2 .. :data:`MAX_BATCHED_QUERY` tokens: speculative verification's
  k + 1, a short chunk) over contexts up to :data:`MAX_BATCHED_CONTEXT`: grouped by query
  length and, where a group has several sequences, done as decode rows are, each query
  token with its own causal (and window) limit, instead of one call per sequence;
- **prefill chunks** (more query tokens, possibly after cached context): one call each,
  with a bottom-right causal (and sliding-window) mask, gathering only the blocks from the
  first one in the chunk's windows; SDPA, or explicit scores when soft-capping (SDPA
  cannot cap); a step holds few of them (the token budget bounds them).

Math is in fp32, as in the reference; the result is cast to the query's dtype. A cache in
another dtype (bf16, fp8, int8 records) is widened as it is gathered (:mod:`.kv_quant`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from pagedserve.kernels.cpu_decode_native import decode_attention_native
from pagedserve.kernels.kv_quant import dequantize
from pagedserve.kernels.reference import check_window_and_soft_cap

__all__ = ["paged_attention_cpu"]


def paged_attention_cpu(
    query: Tensor,  # [T, Hq, D]
    key_cache: Tensor,  # [NB, BS, Hkv, D]
    value_cache: Tensor,  # [NB, BS, Hkv, D]
    block_tables: Tensor,  # [B, max_blocks] int32
    query_start_loc: Tensor,  # [B + 1] int32, cumulative
    seq_lens: Tensor,  # [B] int32
    scale: float,
    *,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> Tensor:  # [T, Hq, D]
    """See :func:`pagedserve.kernels.reference.paged_attention`."""
    del max_seq_len
    window, soft_cap = check_window_and_soft_cap(sliding_window, logits_soft_cap)
    num_q_heads = query.shape[1]
    num_kv_heads = key_cache.shape[2]
    if num_q_heads % num_kv_heads != 0:
        raise ValueError(f"num_q_heads={num_q_heads} not a multiple of num_kv_heads={num_kv_heads}")
    qsl = query_start_loc.long()
    q_lens = qsl[1:] - qsl[:-1]  # [B]
    if bool((q_lens > seq_lens).any()):
        b = int(torch.nonzero(q_lens > seq_lens)[0, 0])
        raise ValueError(
            f"sequence {b}: {int(q_lens[b])} query tokens but seq_len={int(seq_lens[b])}"
        )
    decode = torch.nonzero(q_lens == 1).flatten()
    num_decode = decode.numel()
    pure = num_decode == query.shape[0]  # a pure decode step, no padding rows: no scatter
    rows = None if pure else qsl[decode]  # the decode tokens' rows of ``query``
    decoded = None
    if num_decode:
        q = query if rows is None else query[rows]
        rows_tables, rows_lens = block_tables[decode], seq_lens[decode]
        decoded = decode_attention_native(
            q, key_cache, value_cache, rows_tables, rows_lens, scale, window, soft_cap
        )
        if decoded is None:
            decoded = _decode_bucketed(
                q, key_cache, value_cache, rows_tables, rows_lens, scale, window, soft_cap
            )
        decoded = decoded.to(query.dtype)
    if pure:
        assert decoded is not None
        return decoded
    out = torch.zeros_like(query)
    if decoded is not None:
        out[rows] = decoded
    if max_query_len == 1:
        return out
    short = (q_lens > 1) & (q_lens <= MAX_BATCHED_QUERY) & (seq_lens <= MAX_BATCHED_CONTEXT)
    prefill = torch.nonzero((q_lens > 1) & ~short).flatten().tolist()
    for q_len in sorted(set(q_lens[short].tolist())):
        seqs = torch.nonzero(short & (q_lens == q_len)).flatten()
        if (n := seqs.numel()) == 1:  # one call either way: the prefill's is the cheaper
            prefill.append(int(seqs[0]))
            continue
        rows = (qsl[seqs][:, None] + torch.arange(q_len)).view(-1)  # [n * q_len]
        out[rows] = _decode_bucketed(
            query[rows].view(n, q_len, num_q_heads, -1),
            key_cache,
            value_cache,
            block_tables[seqs],
            seq_lens[seqs],
            scale,
            window,
            soft_cap,
        ).to(query.dtype)
    if prefill:
        starts, lens = qsl.tolist(), seq_lens.tolist()
        for b in prefill:
            q_start, q_end = starts[b], starts[b + 1]
            out[q_start:q_end] = _prefill(
                query[q_start:q_end],
                key_cache,
                value_cache,
                block_tables[b],
                lens[b],
                scale,
                window,
                soft_cap,
            ).to(query.dtype)
    return out


# Decode rows are gathered to their bucket's longest context, so rows of very different
# lengths go in different buckets. Measured on a 2-core AVX-512 machine (64 rows, 2 KV heads,
# head_dim 64, fp32): a bucket costs ~75 us of fixed work (dispatch of its ~25 ops) plus
# ~1.1 us per row-block of 16 KiB of gathered K+V, i.e. one more bucket pays for itself
# once it saves ~1 MiB of padding; and past ~16 MiB gathered per bucket the cost per block
# grows by half (the gathered K/V no longer stay in cache).
SPLIT_BYTES = 1 << 20
MAX_BUCKET_BYTES = 16 << 20
# Query rows up to this long, over contexts up to this long, are batched like decode rows (a
# gather of their blocks, two matmuls per KV head); the others are prefill chunks, one SDPA
# call each. Measured on 2 threads, 5 queries per sequence, 4-64 sequences, heads 8/2 x 64 and
# 32/8 x 128: batched 1.0-5.6x faster up to 512 positions; at 1,024, 0.5-2.0x.
MAX_BATCHED_QUERY = 16
MAX_BATCHED_CONTEXT = 768


def decode_buckets(blocks: list[int], split: int, cap: int) -> list[int]:
    """Cut rows sorted by ascending ``blocks`` (each row's gathered block count) into
    contiguous buckets; the end offset of each bucket.

    A row opens a new bucket when, added to the current one, the bucket's padding (the
    blocks its rows would gather past their own, up to the bucket's longest) would exceed
    ``split`` blocks, or the bucket would gather more than ``cap`` blocks. So each bucket
    wastes at most about what one more bucket costs, and equal lengths make one bucket."""
    ends: list[int] = []
    start, total = 0, 0  # the open bucket's first row and its rows' own blocks
    for i, b in enumerate(blocks):
        rows = i - start + 1
        if i > start and (rows * b - total - b > split or rows * b > cap):
            ends.append(i)
            start, total = i, 0
        total += b
    ends.append(len(blocks))
    return ends


def _decode_bucketed(
    query: Tensor,  # [n, Hq, D]: one token per sequence, or [n, Q, Hq, D]: Q each
    key_cache: Tensor,
    value_cache: Tensor,
    block_tables: Tensor,  # [n, max_blocks]
    seq_lens: Tensor,  # [n]
    scale: float,
    window: int,
    soft_cap: float,
) -> Tensor:  # [n, Hq, D] or [n * Q, Hq, D] fp32
    """:func:`_decode` over buckets of rows of similar length (:func:`decode_buckets`)."""
    block_size = key_cache.shape[1]
    block_bytes = 2 * key_cache[0].numel() * key_cache.element_size()  # K + V of a block
    q_len = query.shape[1] if query.dim() == 4 else 1
    span = _window_blocks(window, q_len, block_size) if window else 0
    lens = seq_lens.tolist()
    blocks = [-(-n // block_size) for n in lens]
    if span:
        blocks = [min(b, span) for b in blocks]
    order = sorted(range(len(lens)), key=blocks.__getitem__)
    ends = decode_buckets(
        [blocks[i] for i in order],
        max(1, SPLIT_BYTES // block_bytes),
        max(1, MAX_BUCKET_BYTES // block_bytes),
    )
    if len(ends) == 1:
        return _decode(
            query, key_cache, value_cache, block_tables, seq_lens, scale, window, soft_cap
        )
    perm = torch.tensor(order)
    q, tables, lens_t = query[perm], block_tables[perm], seq_lens[perm]
    if q_len > 1:  # rows of the output are the query tokens: each sequence's Q in order
        perm = (perm[:, None] * q_len + torch.arange(q_len)).view(-1)
    outs, start = [], 0
    for end in ends:
        outs.append(
            _decode(
                q[start:end],
                key_cache,
                value_cache,
                tables[start:end],
                lens_t[start:end],
                scale,
                window,
                soft_cap,
            )
        )
        start = end
    out = torch.empty((len(perm), *query.shape[-2:]), dtype=torch.float32)
    out[perm] = torch.cat(outs)
    return out


def _window_blocks(window: int, q_len: int, block_size: int) -> int:
    """The most blocks that the windows of ``q_len`` consecutive query tokens span."""
    return (window + q_len - 1 + block_size - 2) // block_size + 1


def _decode(
    query: Tensor,  # [n, Hq, D]: one token per sequence, or [n, Q, Hq, D]: the last Q
    key_cache: Tensor,
    value_cache: Tensor,
    block_tables: Tensor,  # [n, max_blocks]
    seq_lens: Tensor,  # [n]
    scale: float,
    window: int,  # 0: full context
    soft_cap: float,  # 0.0: no capping
) -> Tensor:  # [n, Hq, D] or [n * Q, Hq, D] fp32
    q_len = query.shape[1] if query.dim() == 4 else 1
    n, num_q_heads, head_dim = query.shape[0], query.shape[-2], query.shape[-1]
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = num_q_heads // num_kv_heads
    seq_lens = seq_lens.long()
    num_blocks = -(-int(seq_lens.max()) // block_size)
    # Query i of row r sits at position p = seq_len_r - Q + i and sees keys (p - W, p]; the
    # row's first query sees from first_r = seq_len_r - Q - W + 1 (0 without a window).
    first_pos = (
        (seq_lens - q_len - window + 1).clamp_(min=0) if window else torch.zeros_like(seq_lens)
    )
    if window:
        # The windows span at most this many blocks: gather each row's own blocks from the
        # one holding its first visible position (fewer when all fit).
        num_blocks = min(num_blocks, _window_blocks(window, q_len, block_size))
    first_block = first_pos // block_size  # [n]
    cols = first_block[:, None] + torch.arange(num_blocks)  # [n, nb] block-table columns
    cols.clamp_(max=block_tables.shape[1] - 1)  # past a row's end: any block, masked below
    ids = block_tables.long().gather(1, cols).view(-1)  # [n * nb]
    ctx = num_blocks * block_size  # L: gathered positions per row
    # One gather of every row's blocks, token-major as in the cache: [n, L, Hkv, D].
    k = dequantize(key_cache.index_select(0, ids)).view(n, ctx, num_kv_heads, head_dim)
    v = dequantize(value_cache.index_select(0, ids)).view(n, ctx, num_kv_heads, head_dim)
    # [n, Hkv, G * Q, D]: a KV head's queries of a row, group-major.
    q = query.float().view(n, q_len, num_kv_heads, group, head_dim)
    q = q.permute(0, 2, 3, 1, 4).reshape(n, num_kv_heads, group * q_len, head_dim)
    pos = (first_block * block_size)[:, None] + torch.arange(ctx)  # [n, L] positions
    hidden = pos >= seq_lens[:, None]  # [n, L]: past the row's context ...
    if window:
        hidden |= pos < first_pos[:, None]  # ... or before its windows
    # Slots outside a row's visible range may hold anything, NaN included (unwritten or
    # recycled blocks, the padding block 0): their weight is 0, but 0 * NaN is NaN, so
    # zero them.
    invalid = torch.nonzero(hidden.view(-1)).flatten()  # index_fill: 3x masked_fill's speed
    v.view(n * ctx, -1).index_fill_(0, invalid, 0.0)  # v is this call's own gathered copy
    if q_len > 1:  # each query token's own limits: [n, 1, Q, L]
        q_pos = seq_lens[:, None] - q_len + torch.arange(q_len)  # [n, Q]
        masked = pos[:, None, :] > q_pos[:, :, None]
        if window:
            masked |= pos[:, None, :] <= q_pos[:, :, None] - window
        hidden = masked[:, None]
    else:
        hidden = hidden[:, None, None, :]  # [n, 1, 1, L]
    # Per KV head, two batched matmuls over every row: K and V are read in place (a
    # head's slice is a strided matrix BLAS takes as it is), never transposed or repeated.
    outs = []
    for h in range(num_kv_heads):
        scores = torch.bmm(q[:, h], k[:, :, h].transpose(1, 2)).mul_(scale)  # [n, G*Q, L]
        if soft_cap:
            scores = scores.div_(soft_cap).tanh_().mul_(soft_cap)
        scores.view(n, group, q_len, ctx).masked_fill_(hidden, float("-inf"))
        outs.append(torch.bmm(torch.softmax(scores, dim=-1), v[:, :, h]))  # [n, G*Q, D]
    o = torch.stack(outs, dim=1)  # [n, Hkv, G * Q, D]
    if q_len == 1:
        return o.view(n, num_q_heads, head_dim)
    o = o.view(n, num_kv_heads, group, q_len, head_dim).permute(0, 3, 1, 2, 4)
    return o.reshape(n * q_len, num_q_heads, head_dim)


def _prefill(
    query: Tensor,  # [q_len, Hq, D]
    key_cache: Tensor,
    value_cache: Tensor,
    block_table: Tensor,  # [max_blocks]
    seq_len: int,
    scale: float,
    window: int,  # 0: full context
    soft_cap: float,  # 0.0: no capping
) -> Tensor:  # [q_len, Hq, D] fp32
    q_len, num_q_heads, head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    # Query i sits at position seq_len - q_len + i and sees keys j <= it (bottom-right),
    # and with a window W only j > its position - W: keys before the first query's
    # window are never seen, so the gather starts at the block holding that key.
    first_block = max(0, seq_len - q_len - window + 1) // block_size if window else 0
    kv_start = first_block * block_size
    num_blocks = -(-seq_len // block_size)
    ids = block_table[first_block:num_blocks].long()
    k = dequantize(key_cache.index_select(0, ids)).view(-1, num_kv_heads, head_dim)
    v = dequantize(value_cache.index_select(0, ids)).view(-1, num_kv_heads, head_dim)
    k, v = k[: seq_len - kv_start].transpose(0, 1), v[: seq_len - kv_start].transpose(0, 1)
    q = query.transpose(0, 1).float()  # [Hq, q_len, D]
    q_pos = torch.arange(seq_len - q_len, seq_len)[:, None]  # [q_len, 1]
    k_pos = torch.arange(kv_start, seq_len)[None, :]  # [1, S']
    mask = k_pos <= q_pos  # [q_len, S'] bool, True = attend
    if window:
        mask &= k_pos > q_pos - window
    if not soft_cap:
        o = F.scaled_dot_product_attention(
            q[None], k[None], v[None], attn_mask=mask, scale=scale, enable_gqa=True
        )  # [1, Hq, q_len, D]
        return o[0].transpose(0, 1)
    # Soft-capping happens between the product and the mask: scores made explicitly, per
    # KV head for its whole group ([Hkv, G * q_len, D] x [Hkv, D, S']), K/V not repeated.
    group = num_q_heads // num_kv_heads
    q = q.reshape(num_kv_heads, group * q_len, head_dim)
    scores = torch.bmm(q, k.transpose(1, 2)).mul_(scale).div_(soft_cap).tanh_().mul_(soft_cap)
    scores = scores.view(num_kv_heads, group, q_len, -1).masked_fill_(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1).view(num_kv_heads, group * q_len, -1)
    o = torch.bmm(probs, v).view(num_q_heads, q_len, head_dim)
    return o.transpose(0, 1)
