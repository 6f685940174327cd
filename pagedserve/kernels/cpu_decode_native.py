"""Decode rows of CPU paged attention through the native kernel (``csrc/cpu_decode_attention.c``).

One query token per sequence; K/V read in place in their blocks (no gather, no fp32 copy of a
16-bit cache), only each row's visible positions (its window with one); an online softmax in
fp32; a task per (sequence, KV head) over torch's threads. Built by :mod:`.cpu_native`; where
it is not built (no compiler, ``PAGEDSERVE_CPU_NATIVE=0``) or does not apply (an fp8 or int8
cache, a head dimension over 256), :func:`decode_attention_native` returns None and the
caller keeps the torch path.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

import torch
from torch import Tensor

from pagedserve.kernels import cpu_native

_Kernels = tuple[dict[torch.dtype, Any], int]  # the kernel per cache dtype; the largest D

__all__ = ["decode_attention_native", "native_decode_available"]

_KERNEL = "cpu_decode_attention"
_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}
_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
_ARGTYPES = [_P, _P, _P, _P, _I, _P, _I, _I, _I, _I, _I, _I, _F, _I, _F, _P, ctypes.c_int]


@functools.cache
def _functions(lib: ctypes.CDLL) -> _Kernels:
    functions = {}
    for dtype, suffix in _SUFFIX.items():
        fn = getattr(lib, f"pagedserve_decode_attention_{suffix}")
        fn.argtypes, fn.restype = _ARGTYPES, ctypes.c_int
        functions[dtype] = fn
    return functions, int(lib.pagedserve_max_head_dim())


def _kernels() -> _Kernels | None:
    lib = cpu_native.load(_KERNEL)
    return None if lib is None else _functions(lib)


def native_decode_available() -> bool:
    """Whether the kernel is built (or can be) and enabled here."""
    return _kernels() is not None


def decode_attention_native(
    query: Tensor,  # [n, Hq, D]: one token per sequence
    key_cache: Tensor,  # [NB, BS, Hkv, D]
    value_cache: Tensor,
    block_tables: Tensor,  # [n, max_blocks] int32
    seq_lens: Tensor,  # [n] int32
    scale: float,
    window: int,  # 0: full context
    soft_cap: float,  # 0.0: no capping
) -> Tensor | None:  # [n, Hq, D] fp32
    """The decode rows' attention (the reference's contract), or None where the kernel does
    not apply here. A block id outside the cache in a row's visible blocks raises IndexError,
    as the reference's gather does (ids in columns a row never reads are not looked at)."""
    kernels = _kernels()
    if kernels is None:
        return None
    functions, max_head_dim = kernels
    fn = functions.get(key_cache.dtype)
    n, num_q_heads, head_dim = query.shape
    if (
        fn is None
        or value_cache.dtype != key_cache.dtype
        or head_dim > max_head_dim
        or not (key_cache.is_contiguous() and value_cache.is_contiguous())
        or key_cache.device.type != "cpu"
    ):
        return None
    q = query.to(torch.float32).contiguous()
    tables = block_tables.to(torch.int32)
    if tables.stride(-1) != 1:
        tables = tables.contiguous()
    lens = seq_lens.to(torch.int32).contiguous()
    out = torch.empty((n, num_q_heads, head_dim), dtype=torch.float32)
    if n:
        bad = fn(
            q.data_ptr(),
            key_cache.data_ptr(),
            value_cache.data_ptr(),
            tables.data_ptr(),
            tables.stride(0),
            lens.data_ptr(),
            n,
            num_q_heads,
            key_cache.shape[2],
            head_dim,
            key_cache.shape[0],
            key_cache.shape[1],
            scale,
            window,
            soft_cap,
            out.data_ptr(),
            torch.get_num_threads(),
        )
        if bad:
            raise IndexError(
                f"block tables name a block outside the cache of {key_cache.shape[0]} blocks "
                f"({bad} (sequence, KV head) pairs)"
            )
    return out
