"""Triton kernel: rotary position embedding applied in place to q and k.

Grid ``(T,)``: one program rotates every query and key head of one token by its position,
NeoX style (the halves of each head form the pairs, as in HF Llama):
``(x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin)`` with ``cos, sin = table[position]``,
in fp32, rounded once to the model dtype. q and k may be strided views of a fused QKV
projection (head_dim contiguous).
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

__all__ = ["rotary_embedding_triton"]


@triton.jit
def _rotate_heads(
    x_ptr,
    row,
    stride_tok,
    stride_head,
    num_heads,
    cos,  # [HALF_PAD] fp32
    sin,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    HEADS_PAD: tl.constexpr,
):
    heads = tl.arange(0, HEADS_PAD)
    offs = tl.arange(0, HALF_PAD)
    mask = (heads < num_heads)[:, None] & (offs < HALF)[None, :]
    base = x_ptr + row * stride_tok + heads[:, None].to(tl.int64) * stride_head + offs[None, :]
    x1 = tl.load(base, mask=mask, other=0.0)
    x2 = tl.load(base + HALF, mask=mask, other=0.0)
    a, b = x1.to(tl.float32), x2.to(tl.float32)
    tl.store(base, (a * cos[None, :] - b * sin[None, :]).to(x1.dtype), mask=mask)
    tl.store(base + HALF, (b * cos[None, :] + a * sin[None, :]).to(x1.dtype), mask=mask)


@triton.jit
def _rotary_kernel(
    positions_ptr,  # [T]
    q_ptr,  # [T, Hq, D]
    k_ptr,  # [T, Hkv, D]
    cos_ptr,  # [max_len, D/2]
    sin_ptr,  # [max_len, D/2]
    num_q_heads,
    num_k_heads,
    stride_q_tok,
    stride_q_head,
    stride_k_tok,
    stride_k_head,
    stride_table,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    Q_HEADS_PAD: tl.constexpr,
    K_HEADS_PAD: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + row).to(tl.int64)
    offs = tl.arange(0, HALF_PAD)
    tmask = offs < HALF
    cos = tl.load(cos_ptr + pos * stride_table + offs, mask=tmask, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + pos * stride_table + offs, mask=tmask, other=0.0).to(tl.float32)
    _rotate_heads(
        q_ptr, row, stride_q_tok, stride_q_head, num_q_heads, cos, sin, HALF, HALF_PAD, Q_HEADS_PAD
    )
    _rotate_heads(
        k_ptr, row, stride_k_tok, stride_k_head, num_k_heads, cos, sin, HALF, HALF_PAD, K_HEADS_PAD
    )


def rotary_embedding_triton(
    positions: Tensor,  # [T] int
    query: Tensor,  # [T, Hq, D], rotated in place
    key: Tensor,  # [T, Hkv, D], rotated in place
    cos: Tensor,  # [max_len, D/2]
    sin: Tensor,  # [max_len, D/2]
) -> None:
    """Triton ``rotary_embedding``; contract of :func:`.reference.rotary_embedding`."""
    num_tokens, num_q_heads, head_dim = query.shape
    if key.dim() != 3 or key.shape[0] != num_tokens or key.shape[2] != head_dim:
        raise ValueError(
            f"rotary_embedding: key {tuple(key.shape)} does not match query {tuple(query.shape)}"
        )
    if head_dim % 2 or cos.shape[1] != head_dim // 2 or sin.shape != cos.shape:
        raise ValueError(
            f"rotary_embedding: tables {tuple(cos.shape)} / {tuple(sin.shape)} "
            f"must be [max_len, {head_dim // 2}]"
        )
    if query.stride(-1) != 1 or key.stride(-1) != 1 or cos.stride(-1) != 1:
        raise ValueError("rotary_embedding: head_dim must be contiguous")
    if positions.shape != (num_tokens,):
        raise ValueError(f"rotary_embedding: positions {tuple(positions.shape)} != ({num_tokens},)")
    if num_tokens == 0:
        return
    half = head_dim // 2
    _rotary_kernel[(num_tokens,)](
        positions,
        query,
        key,
        cos,
        sin,
        num_q_heads,
        key.shape[1],
        query.stride(0),
        query.stride(1),
        key.stride(0),
        key.stride(1),
        cos.stride(0),
        HALF=half,
        HALF_PAD=triton.next_power_of_2(half),
        Q_HEADS_PAD=triton.next_power_of_2(num_q_heads),
        K_HEADS_PAD=triton.next_power_of_2(key.shape[1]),
    )
