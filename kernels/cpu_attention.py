"""Paged attention for the CPU, built for speed (``kernels/reference.py`` stays the oracle).

Same contract as :func:`kernels.reference.paged_attention`. The batch is split by query
length:

- **decode rows** (one query token): all of them in one batched computation per KV-head
  group: one gather of their blocks (the batch's longest context, block-aligned), a length
  mask, two batched matmuls and a softmax; grouped-query attention by viewing the query heads
  as ``[Hkv, group]``, never by repeating K/V;
- **prefill chunks** (several query tokens, possibly after cached context): one call each,
  with a bottom-right causal mask; a step holds few of them (the token budget bounds them).

Math is in fp32, as in the reference; the result is cast to the query's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

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
) -> Tensor:  # [T, Hq, D]
    """See :func:`kernels.reference.paged_attention`."""
    del max_seq_len
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
    if num_decode == query.shape[0]:  # a pure decode step, no padding rows: no scatter
        return _decode(
            query, key_cache, value_cache, block_tables[decode], seq_lens[decode], scale
        ).to(query.dtype)
    out = torch.zeros_like(query)
    if num_decode:
        rows = qsl[decode]  # the decode tokens' rows of ``query``
        out[rows] = _decode(
            query[rows], key_cache, value_cache, block_tables[decode], seq_lens[decode], scale
        ).to(query.dtype)
    prefill = [] if max_query_len == 1 else torch.nonzero(q_lens > 1).flatten().tolist()
    if prefill:
        starts, lens = qsl.tolist(), seq_lens.tolist()
        for b in prefill:
            q_start, q_end = starts[b], starts[b + 1]
            out[q_start:q_end] = _prefill(
                query[q_start:q_end], key_cache, value_cache, block_tables[b], lens[b], scale
            ).to(query.dtype)
    return out


def _decode(
    query: Tensor,  # [n, Hq, D]: one token per sequence
    key_cache: Tensor,
    value_cache: Tensor,
    block_tables: Tensor,  # [n, max_blocks]
    seq_lens: Tensor,  # [n]
    scale: float,
) -> Tensor:  # [n, Hq, D] fp32
    n, num_q_heads, head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = num_q_heads // num_kv_heads
    num_blocks = -(-int(seq_lens.max()) // block_size)
    ids = block_tables[:, :num_blocks].reshape(-1).long()  # [n * nb]
    ctx = num_blocks * block_size  # L: the longest context, block-aligned
    # One gather of every row's blocks, token-major as in the cache: [n, L, Hkv, D].
    k = key_cache.index_select(0, ids).view(n, ctx, num_kv_heads, head_dim).float()
    v = value_cache.index_select(0, ids).view(n, ctx, num_kv_heads, head_dim).float()
    q = query.float().view(n, num_kv_heads, group, head_dim)  # [n, Hkv, G, D]
    past_end = torch.arange(ctx)[None, None, :] >= seq_lens[:, None, None]  # [n, 1, L]
    # Slots past a row's context may hold anything, NaN included (unwritten or recycled
    # blocks, the padding block 0): their weight is 0, but 0 * NaN is NaN, so zero them.
    invalid = torch.nonzero(past_end.view(-1)).flatten()  # index_fill: 3x masked_fill's speed
    v.view(n * ctx, -1).index_fill_(0, invalid, 0.0)  # v is this call's own gathered copy
    # Per KV head, two batched matmuls over every row: K and V are read in place (a
    # head's slice is a strided matrix BLAS takes as it is), never transposed or repeated.
    outs = []
    for h in range(num_kv_heads):
        scores = torch.bmm(q[:, h], k[:, :, h].transpose(1, 2)).mul_(scale)  # [n, G, L]
        scores.masked_fill_(past_end, float("-inf"))
        outs.append(torch.bmm(torch.softmax(scores, dim=-1), v[:, :, h]))  # [n, G, D]
    return torch.stack(outs, dim=1).view(n, num_q_heads, head_dim)


def _prefill(
    query: Tensor,  # [q_len, Hq, D]
    key_cache: Tensor,
    value_cache: Tensor,
    block_table: Tensor,  # [max_blocks]
    seq_len: int,
    scale: float,
) -> Tensor:  # [q_len, Hq, D] fp32
    q_len, _, head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    num_blocks = -(-seq_len // block_size)
    ids = block_table[:num_blocks].long()
    k = key_cache.index_select(0, ids).view(-1, num_kv_heads, head_dim)[:seq_len]
    v = value_cache.index_select(0, ids).view(-1, num_kv_heads, head_dim)[:seq_len]
    k, v = k.transpose(0, 1).float(), v.transpose(0, 1).float()  # [Hkv, S, D]
    q = query.transpose(0, 1).float()  # [Hq, q_len, D]
    # Query i sits at position seq_len - q_len + i and sees keys j <= it (bottom-right).
    q_pos = torch.arange(seq_len - q_len, seq_len)
    mask = torch.arange(seq_len)[None, :] <= q_pos[:, None]  # [q_len, S]
    o = F.scaled_dot_product_attention(
        q[None], k[None], v[None], attn_mask=mask, scale=scale, enable_gqa=True
    )  # [1, Hq, q_len, D]
    return o[0].transpose(0, 1)
