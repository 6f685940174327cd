"""A decoder layer's small steps on the CPU in one native pass each (``csrc/cpu_layer_ops.c``):
the residual add with RMSNorm, NeoX rotary, SiLU-and-mul and the K/V write into the cache.

In torch each is five to fifteen ops; at a decode step's sizes their dispatch, not their
arithmetic, is the cost. Each function here answers for fp32 CPU tensors laid out as the
model lays them (a row's features contiguous), and returns None (or False) elsewhere: other
dtypes, an fp8 or int8 cache, native kernels off (``PAGEDSERVE_CPU_NATIVE=0``) or not built.
The caller then runs the reference. Results equal the reference's up to fp32 rounding.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

import torch
from torch import Tensor

from pagedserve.kernels import cpu_native

__all__ = ["add_rms_norm", "rotary", "silu_and_mul", "write_kv"]

_KERNEL = "cpu_layer_ops"
_P, _I, _F, _C = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
_SIGNATURES: dict[str, tuple[list[Any], Any]] = {
    "add_rms_norm_f32": ([_P, _I, _P, _P, _P, _I, _I, _F, _C, _C], None),
    "rotary_f32": ([_P, _P, _I, _I, _I, _P, _I, _I, _I, _P, _P, _I, _I, _I, _C], _I),
    "silu_and_mul_f32": ([_P, _I, _P, _I, _I, _C], None),
    "write_kv": ([_P, _I, _P, _I, _P, _P, _P, _I, _I, _I], _I),
}


@functools.cache
def _bind(lib: ctypes.CDLL) -> dict[str, Any]:
    functions = {}
    for name, (argtypes, restype) in _SIGNATURES.items():
        fn = getattr(lib, f"pagedserve_{name}")
        fn.argtypes, fn.restype = argtypes, restype
        functions[name] = fn
    return functions


def _kernel(name: str) -> Any:
    lib = cpu_native.load(_KERNEL)
    return None if lib is None else _bind(lib)[name]


def _rows_of_f32(*tensors: Tensor) -> bool:
    """Each a 2-D or wider fp32 CPU tensor whose last dimension is contiguous."""
    return all(
        t.dtype == torch.float32 and t.device.type == "cpu" and t.stride(-1) == 1 for t in tensors
    )


def add_rms_norm(
    x: Tensor, residual: Tensor | None, weight: Tensor, eps: float, unit_offset: bool
) -> Tensor | None:
    """:func:`pagedserve.kernels.reference.fused_add_rms_norm` ([T, H]; ``residual`` updated
    in place), or None where this path does not apply."""
    fn = _kernel("add_rms_norm_f32")
    if fn is None or x.dim() != 2 or not _rows_of_f32(x, weight):
        return None
    rows, width = x.shape
    if residual is not None and not (_rows_of_f32(residual) and residual.is_contiguous()):
        return None
    weight = weight.contiguous()
    out = torch.empty((rows, width), dtype=torch.float32)
    fn(
        x.data_ptr(),
        x.stride(0),
        None if residual is None else residual.data_ptr(),
        weight.data_ptr(),
        out.data_ptr(),
        rows,
        width,
        eps,
        int(unit_offset),
        torch.get_num_threads(),
    )
    return out


def rotary(positions: Tensor, query: Tensor, key: Tensor, cos: Tensor, sin: Tensor) -> bool:
    """:func:`pagedserve.kernels.reference.rotary_embedding` in place (``query`` [T, Hq, R],
    ``key`` [T, Hkv, R], each a view whose heads may be wider than R); False where this path
    does not apply. A position outside the tables raises IndexError, nothing rotated."""
    fn = _kernel("rotary_f32")
    if (
        fn is None
        or query.dim() != 3
        or key.dim() != 3
        or not _rows_of_f32(query, key, cos, sin)
        or not (cos.is_contiguous() and sin.is_contiguous())
        or positions.device.type != "cpu"
    ):
        return False
    half = cos.shape[1]
    if query.shape[2] != 2 * half or key.shape[2] != 2 * half:
        return False
    pos = positions.to(torch.int64).contiguous()
    bad = fn(
        pos.data_ptr(),
        query.data_ptr(),
        query.stride(0),
        query.stride(1),
        query.shape[1],
        key.data_ptr(),
        key.stride(0),
        key.stride(1),
        key.shape[1],
        cos.data_ptr(),
        sin.data_ptr(),
        cos.shape[0],
        half,
        query.shape[0],
        torch.get_num_threads(),
    )
    if bad:
        raise IndexError(f"{bad} positions outside the rotary tables of {cos.shape[0]} positions")
    return True


def silu_and_mul(x: Tensor) -> Tensor | None:
    """:func:`pagedserve.kernels.reference.silu_and_mul` ([T, 2I] -> [T, I]), or None where
    this path does not apply."""
    fn = _kernel("silu_and_mul_f32")
    if fn is None or x.dim() != 2 or not _rows_of_f32(x):
        return None
    rows, width = x.shape[0], x.shape[1] // 2
    out = torch.empty((rows, width), dtype=torch.float32)
    fn(x.data_ptr(), x.stride(0), out.data_ptr(), rows, width, torch.get_num_threads())
    return out


def _rows_contiguous(t: Tensor) -> bool:
    """[T, Hkv, D] whose (Hkv, D) part is one contiguous row per token."""
    return t.dim() == 3 and t.stride(2) == 1 and t.stride(1) == t.shape[2]


def write_kv(
    key: Tensor, value: Tensor, key_cache: Tensor, value_cache: Tensor, slot_mapping: Tensor
) -> bool:
    """:func:`pagedserve.kernels.reference.reshape_and_cache` where K/V are stored as they are
    (the cache's dtype is theirs); False where this path does not apply. A slot past the
    cache raises IndexError, nothing written."""
    fn = _kernel("write_kv")
    if (
        fn is None
        or not (key.dtype == value.dtype == key_cache.dtype == value_cache.dtype)
        or key.device.type != "cpu"
        or key_cache.device.type != "cpu"
        or not (_rows_contiguous(key) and _rows_contiguous(value))
        or not (key_cache.is_contiguous() and value_cache.is_contiguous())
        or key.shape != value.shape
        or key_cache.shape != value_cache.shape
        or key.shape[1:] != key_cache.shape[2:]
        or slot_mapping.shape != key.shape[:1]
    ):
        return False
    slots = slot_mapping.to(torch.int64).contiguous()
    size = key.element_size()
    num_slots = key_cache.shape[0] * key_cache.shape[1]
    bad = fn(
        key.data_ptr(),
        key.stride(0) * size,
        value.data_ptr(),
        value.stride(0) * size,
        key_cache.data_ptr(),
        value_cache.data_ptr(),
        slots.data_ptr(),
        key.shape[0],
        key.shape[1] * key.shape[2] * size,
        num_slots,
    )
    if bad:
        raise IndexError(f"{bad} slots outside the cache of {num_slots} slots")
    return True
