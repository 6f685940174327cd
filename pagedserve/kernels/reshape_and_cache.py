"""Triton kernel writing new tokens' K/V into the paged cache.

Grid ``(T, cdiv(Hkv, HEAD_BLOCK))``: one program copies ``HEAD_BLOCK`` heads of one
token's key and value to ``slot = slot_mapping[t]``, i.e. block ``slot // BS`` at offset
``slot % BS``. A negative slot marks a padding token: the program returns without
touching the cache. Slot arithmetic is int64 (``block_id * block_stride`` overflows
int32 in caches over 2^31 elements).

A cache in a narrower float (bf16, fp8) gets K/V cast on the store; an int8 cache gets each
head's record (:mod:`.kv_quant`): the codes rounded half away from zero, then the fp32 scale.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from pagedserve.kernels.kv_quant import cache_head_dim, is_int8_records

__all__ = ["reshape_and_cache_triton"]

_MAX_TILE_ELEMS = 4096  # heads x head_dim handled by one program


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr,  # [T, Hkv, D]
    value_ptr,  # [T, Hkv, D]
    key_cache_ptr,  # [NB, BS, Hkv, D]
    value_cache_ptr,  # [NB, BS, Hkv, D]
    slot_mapping_ptr,  # [T]
    num_kv_heads,
    stride_k_tok,
    stride_k_head,
    stride_v_tok,
    stride_v_head,
    stride_kc_blk,
    stride_kc_tok,
    stride_kc_head,
    stride_vc_blk,
    stride_vc_tok,
    stride_vc_head,
    BLOCK_SIZE: tl.constexpr,
    HEAD_BLOCK: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    INT8_RECORDS: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + tok).to(tl.int64)
    if slot < 0:
        return  # padding token
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    heads = (tl.program_id(1) * HEAD_BLOCK + tl.arange(0, HEAD_BLOCK)).to(tl.int64)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    mask = (heads < num_kv_heads)[:, None] & (offs_d < HEAD_DIM)[None, :]
    src = heads[:, None] * stride_k_head + offs_d[None, :]
    k = tl.load(key_ptr + tok * stride_k_tok + src, mask=mask, other=0.0)
    dst = block * stride_kc_blk + offset * stride_kc_tok + heads[:, None] * stride_kc_head
    _store_heads(key_cache_ptr + dst, k, offs_d, mask, heads < num_kv_heads, HEAD_DIM, INT8_RECORDS)
    src = heads[:, None] * stride_v_head + offs_d[None, :]
    v = tl.load(value_ptr + tok * stride_v_tok + src, mask=mask, other=0.0)
    dst = block * stride_vc_blk + offset * stride_vc_tok + heads[:, None] * stride_vc_head
    _store_heads(
        value_cache_ptr + dst, v, offs_d, mask, heads < num_kv_heads, HEAD_DIM, INT8_RECORDS
    )


@triton.jit
def _store_heads(
    ptrs,  # [HEAD_BLOCK, 1]: each head's first element in the cache
    x,  # [HEAD_BLOCK, HEAD_DIM_PAD], zero past HEAD_DIM
    offs_d,
    mask,
    head_mask,  # [HEAD_BLOCK]
    HEAD_DIM: tl.constexpr,
    INT8_RECORDS: tl.constexpr,
):
    if INT8_RECORDS:
        xf = x.to(tl.float32)
        # div_rn: IEEE division, as torch's (a plain fp32 `/` is approximate on CUDA)
        scale = tl.div_rn(tl.maximum(tl.max(tl.abs(xf), axis=1), 1e-12), 127.0)  # [HEAD_BLOCK]
        codes = tl.minimum(tl.floor(tl.abs(tl.div_rn(xf, scale[:, None])) + 0.5), 127.0)
        codes = tl.where(xf < 0, -codes, codes)
        tl.store(ptrs + offs_d[None, :], codes.to(tl.int8), mask=mask)
        scale_ptrs = (ptrs + HEAD_DIM).to(tl.pointer_type(tl.float32))
        tl.store(scale_ptrs, scale[:, None], mask=head_mask[:, None])
    else:
        tl.store(ptrs + offs_d[None, :], x.to(ptrs.dtype.element_ty), mask=mask)


def _check(
    key: Tensor, value: Tensor, key_cache: Tensor, value_cache: Tensor, slot_mapping: Tensor
) -> None:
    def fail(msg: str) -> None:
        raise ValueError(f"reshape_and_cache: {msg}")

    if key.dim() != 3 or value.shape != key.shape:
        fail(f"key/value must both be [T, Hkv, D], got {tuple(key.shape)} / {tuple(value.shape)}")
    if key_cache.dim() != 4 or value_cache.shape != key_cache.shape:
        fail(
            f"key_cache/value_cache must both be [NB, BS, Hkv, D], got "
            f"{tuple(key_cache.shape)} / {tuple(value_cache.shape)}"
        )
    heads, head_dim = key.shape[1:]
    width = cache_head_dim(head_dim, key_cache.dtype)
    if tuple(key_cache.shape[2:]) != (heads, width):
        fail(
            f"cache heads/head_dim {tuple(key_cache.shape[2:])} != key {tuple(key.shape[1:])}"
            + (f" as int8 records ({width} bytes)" if width != head_dim else "")
        )
    if slot_mapping.shape != (key.shape[0],) or slot_mapping.dtype not in (
        torch.int64,
        torch.int32,
    ):
        fail(
            f"slot_mapping must be [T] = [{key.shape[0]}] int64, got "
            f"{slot_mapping.dtype} {tuple(slot_mapping.shape)}"
        )
    if not slot_mapping.is_contiguous():
        fail("slot_mapping must be contiguous")
    if value.dtype != key.dtype:
        fail(f"value dtype {value.dtype} != key dtype {key.dtype}")
    if value_cache.dtype != key_cache.dtype:
        fail(f"value_cache dtype {value_cache.dtype} != key_cache dtype {key_cache.dtype}")
    tensors = {
        "key": key,
        "value": value,
        "key_cache": key_cache,
        "value_cache": value_cache,
        "slot_mapping": slot_mapping,
    }
    for name, t in tensors.items():
        if t.device != key.device:
            fail(f"{name} is on {t.device}, key on {key.device}")
    for name, t in (
        ("key", key),
        ("value", value),
        ("key_cache", key_cache),
        ("value_cache", value_cache),
    ):
        if t.stride(-1) != 1:
            fail(f"{name} must be contiguous in head_dim (stride(-1) == 1), got {t.stride()}")


def reshape_and_cache_triton(
    key: Tensor,  # [T, Hkv, D]
    value: Tensor,  # [T, Hkv, D]
    key_cache: Tensor,  # [NB, BS, Hkv, D]
    value_cache: Tensor,  # [NB, BS, Hkv, D]
    slot_mapping: Tensor,  # [T] int64, < 0 = padding
) -> None:
    """Triton ``reshape_and_cache``; contract of :func:`.reference.reshape_and_cache`.

    Key/value may be strided views (e.g. slices of a fused QKV projection) as long as
    head_dim is contiguous.
    """
    _check(key, value, key_cache, value_cache, slot_mapping)
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    head_dim_pad = triton.next_power_of_2(head_dim)
    head_block = min(triton.next_power_of_2(num_kv_heads), max(1, _MAX_TILE_ELEMS // head_dim_pad))
    grid = (num_tokens, triton.cdiv(num_kv_heads, head_block))
    _reshape_and_cache_kernel[grid](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        num_kv_heads,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        value_cache.stride(0),
        value_cache.stride(1),
        value_cache.stride(2),
        BLOCK_SIZE=key_cache.shape[1],
        HEAD_BLOCK=head_block,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        INT8_RECORDS=is_int8_records(key_cache),
        num_warps=4,
    )
