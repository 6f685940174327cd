"""How a KV cache stores K/V in another dtype than the model computes in.

Three storages, told apart by the cache tensor's dtype alone:

- **the compute dtype** (or any wider float): K/V as they are;
- **a narrower float** (``bfloat16`` under an fp32 model, ``float8_e4m3fn``, ``float8_e5m2``):
  K/V cast on write, widened on read. An fp8 cache's per-layer ``k_scale`` / ``v_scale`` are
  applied by the attention layer around the kernels (K/V divided before the write, the
  scores' scale and the output multiplied after), so the kernels only cast;
- **int8 per token and head** (vLLM's ``int8_per_token_head``): each token's head vector is
  one *record* of ``head_dim + 4`` bytes: ``head_dim`` int8 codes, then the fp32 scale
  ``max|x| / 127`` (stored little-endian, as the host's and the GPU's fp32). The record is
  the cache's last dimension, so a block holds its own scales: copy-on-write, swap, the
  host and disk tiers copy them with the codes, byte for byte, and nothing sizes or moves
  a separate scale buffer. Codes round half away from zero.

The functions here are the torch definitions every path is tested against (the CPU
attention uses them as they are; the Triton kernels do the same arithmetic in-kernel).
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

__all__ = [
    "INT8_SCALE_BYTES",
    "cache_head_dim",
    "dequantize",
    "encode",
    "head_dim_of",
    "is_int8_records",
    "quantize_int8",
]

#: Bytes of the fp32 scale closing each int8 record.
INT8_SCALE_BYTES = 4
_INT8_MAX = 127.0
# A zero vector gets this scale (its codes are all 0): never a division by zero.
_MIN_AMAX = 1e-12

_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def is_int8_records(cache: Tensor | torch.dtype) -> bool:
    """Whether a cache (or a cache dtype) stores int8 records."""
    dtype = cache if isinstance(cache, torch.dtype) else cache.dtype
    return dtype == torch.int8


def cache_head_dim(head_dim: int, cache_dtype: torch.dtype) -> int:
    """The cache's last dimension for heads of ``head_dim``: a record's bytes for int8.

    Raises ``ValueError`` for an int8 cache whose records would put the fp32 scale off its
    4-byte alignment (``head_dim`` not a multiple of 4)."""
    if not is_int8_records(cache_dtype):
        return head_dim
    if head_dim % INT8_SCALE_BYTES:
        raise ValueError(f"an int8 KV cache needs head_dim a multiple of 4, got {head_dim}")
    return head_dim + INT8_SCALE_BYTES


def head_dim_of(cache: Tensor) -> int:
    """The head dimension a cache's last dimension stores."""
    width = cache.shape[-1]
    return width - INT8_SCALE_BYTES if is_int8_records(cache) else width


def quantize_int8(x: Tensor) -> Tensor:  # [..., D] float -> [..., D + 4] int8
    """Int8 records of ``x``, one per vector of its last dimension."""
    head_dim = x.shape[-1]
    cache_head_dim(head_dim, torch.int8)  # the alignment check
    xf = x.float()
    scale = xf.abs().amax(dim=-1, keepdim=True).clamp_(min=_MIN_AMAX).div_(_INT8_MAX)
    q = xf / scale
    codes = q.abs_().add_(0.5).floor_().clamp_(max=_INT8_MAX).copysign_(xf)
    out = torch.empty((*x.shape[:-1], head_dim + INT8_SCALE_BYTES), dtype=torch.int8)
    out = out.to(x.device)
    out[..., :head_dim] = codes.to(torch.int8)
    out[..., head_dim:] = scale.view(torch.int8)
    return out


def encode(x: Tensor, cache_dtype: torch.dtype) -> Tensor:
    """``x`` as a cache of ``cache_dtype`` stores it (an fp8 cache's values already scaled)."""
    if is_int8_records(cache_dtype):
        return quantize_int8(x)
    return x.to(cache_dtype)


@functools.cache
def _fp8_table(dtype: torch.dtype) -> Tensor:
    """Every value of an 8-bit float dtype, as fp32, by bit pattern."""
    return torch.arange(256, dtype=torch.uint8).view(dtype).float()


def dequantize(t: Tensor) -> Tensor:  # [..., W] cache elements -> [..., D] fp32
    """Cache elements (gathered blocks, any leading shape) as fp32 K/V, a new tensor unless
    ``t`` already is fp32. fp8 goes through a 256-entry table: on the CPU, 3x torch's own
    conversion measured."""
    if is_int8_records(t):
        head_dim = t.shape[-1] - INT8_SCALE_BYTES
        scale = t[..., head_dim:].contiguous().view(torch.float32)  # [..., 1]
        return t[..., :head_dim].float().mul_(scale)
    if t.dtype in _FP8 and t.device.type == "cpu":
        codes = t.reshape(-1).view(torch.uint8).int()
        return _fp8_table(t.dtype).index_select(0, codes).view(t.shape)
    return t.float()
