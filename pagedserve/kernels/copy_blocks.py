"""Triton kernel copying whole KV blocks, for copy-on-write.

Grid ``(N, 2 * L, cdiv(block_elems, CHUNK))``: a program copies one ``CHUNK`` of block
``src[i]`` to block ``dst[i]`` in one layer's K or V cache. A block's
``[BS, Hkv, D]`` payload must be contiguous (it is in the executor's single
allocation); layer, K/V and block strides are taken from the tensor, in int64.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

__all__ = ["copy_blocks_triton"]

_CHUNK = 4096  # elements per program


@triton.jit
def _copy_blocks_kernel(
    kv_cache_ptr,  # [L, 2, NB, BS, Hkv, D]
    src_ptr,  # [N]
    dst_ptr,  # [N]
    block_elems,  # BS * Hkv * D
    stride_layer,
    stride_kv,
    stride_blk,
    CHUNK: tl.constexpr,
):
    pair = tl.program_id(0)
    layer_kv = tl.program_id(1)
    chunk = tl.program_id(2)
    src = tl.load(src_ptr + pair).to(tl.int64)
    dst = tl.load(dst_ptr + pair).to(tl.int64)
    base = (layer_kv // 2).to(tl.int64) * stride_layer + (layer_kv % 2).to(tl.int64) * stride_kv
    offs = chunk.to(tl.int64) * CHUNK + tl.arange(0, CHUNK)
    mask = offs < block_elems
    x = tl.load(kv_cache_ptr + base + src * stride_blk + offs, mask=mask)
    tl.store(kv_cache_ptr + base + dst * stride_blk + offs, x, mask=mask)


def copy_blocks_triton(
    kv_cache: Tensor,  # [L, 2, NB, BS, Hkv, D]
    src: Tensor,  # [N] int64
    dst: Tensor,  # [N] int64
) -> None:
    """Triton ``copy_blocks``; contract of :func:`pagedserve.kernels.reference.copy_blocks`."""

    def fail(msg: str) -> None:
        raise ValueError(f"copy_blocks: {msg}")

    if kv_cache.dim() != 6 or kv_cache.shape[1] != 2:
        fail(f"kv_cache must be [L, 2, NB, BS, Hkv, D], got {tuple(kv_cache.shape)}")
    for name, t in (("src", src), ("dst", dst)):
        if t.dim() != 1 or t.dtype not in (torch.int64, torch.int32):
            fail(f"{name} must be [N] int64, got {t.dtype} {tuple(t.shape)}")
        if t.device != kv_cache.device:
            fail(f"{name} is on {t.device}, kv_cache on {kv_cache.device}")
        if not t.is_contiguous():
            fail(f"{name} must be contiguous")
    if src.shape != dst.shape:
        fail(f"src {tuple(src.shape)} and dst {tuple(dst.shape)} differ in length")
    num_layers, _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    # The [BS, Hkv, D] payload of a block must be one contiguous run of elements.
    payload = kv_cache[0, 0, 0] if kv_cache.shape[2] > 0 else None
    if payload is not None and not payload.is_contiguous():
        fail(f"each block's [BS, Hkv, D] payload must be contiguous, strides {kv_cache.stride()}")
    num_pairs = src.shape[0]
    block_elems = block_size * num_kv_heads * head_dim
    if num_pairs == 0 or block_elems == 0 or num_layers == 0:
        return
    chunk = min(_CHUNK, triton.next_power_of_2(block_elems))
    grid = (num_pairs, 2 * num_layers, triton.cdiv(block_elems, chunk))
    _copy_blocks_kernel[grid](
        kv_cache,
        src,
        dst,
        block_elems,
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        CHUNK=chunk,
        num_warps=4,
    )
