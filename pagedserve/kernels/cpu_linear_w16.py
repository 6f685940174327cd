"""Linear layers with 16-bit weights (bf16 or fp16) multiplied in fp32 on the CPU
(``csrc/cpu_linear_w16.c``).

A CPU without bf16 or fp16 arithmetic (no AVX512-BF16, AVX512-FP16 or AMX) runs torch's bf16
matmuls by converting operands in oneDNN's reference paths, slower than fp32. This kernel
keeps the activations in fp32 and widens each weight to fp32 in registers as it streams them:
half the weight bytes of fp32, the arithmetic of fp32. It is what llama.cpp's F16 files do on
such a CPU.

:func:`pack` lays a ``[N, K]`` weight out as the kernel reads it; :func:`linear` returns
``x @ W^T + bias`` with ``W`` the packed 16-bit values widened (exactly) to fp32: the result
of ``F.linear(x, unpack(...), bias)`` up to fp32 rounding. :func:`linear` returns None where
native kernels are off or cannot be built; :func:`unpack` is then the caller's way back.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

import torch
from torch import Tensor

from pagedserve.kernels import cpu_native

__all__ = ["BLOCK_COLUMNS", "WEIGHT_DTYPES", "linear", "pack", "unpack"]

_KERNEL = "cpu_linear_w16"
BLOCK_COLUMNS = 32  # NB in the C source
WEIGHT_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
_P, _I, _C = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_ARGTYPES = [_P, _I, _P, _P, _P, _I, _I, _I, _C, _C]


@functools.cache
def _bind(lib: ctypes.CDLL, portable: bool) -> Any:
    fn = getattr(lib, "pagedserve_linear_w16_portable" if portable else "pagedserve_linear_w16")
    fn.argtypes, fn.restype = _ARGTYPES, ctypes.c_int
    return fn


def pack(weight: Tensor, fmt: str) -> Tensor:
    """``weight`` ``[N, K]`` rounded to ``fmt`` (``bf16`` or ``fp16``, round to nearest even)
    as ``[ceil(N / 32), K, 32]``: each block of 32 output columns one contiguous stream, the
    last block's missing columns zeros."""
    if fmt not in WEIGHT_DTYPES:
        raise ValueError(f"weight format {fmt!r}: choose one of {sorted(WEIGHT_DTYPES)}")
    if weight.dim() != 2:
        raise ValueError(f"a linear weight is [out, in]; got shape {tuple(weight.shape)}")
    n, k = weight.shape
    blocks = -(-n // BLOCK_COLUMNS)
    padded = torch.zeros(blocks * BLOCK_COLUMNS, k, dtype=WEIGHT_DTYPES[fmt])
    padded[:n] = weight.detach()
    return padded.view(blocks, BLOCK_COLUMNS, k).transpose(1, 2).contiguous()


def unpack(packed: Tensor, out_features: int) -> Tensor:
    """The fp32 ``[out_features, K]`` weight whose values ``packed`` holds (exact)."""
    blocks, k, cols = packed.shape
    return packed.transpose(1, 2).reshape(blocks * cols, k)[:out_features].float()


def linear(
    x: Tensor, packed: Tensor, bias: Tensor | None, out_features: int, *, portable: bool = False
) -> Tensor | None:
    """``x [M, K] @ W^T + bias`` for fp32 CPU ``x`` whose rows are contiguous, in fp32 (the
    kernel's portable path where ``portable``, as a CPU without AVX-512 runs it); None where
    native kernels are off or not built."""
    lib = cpu_native.load(_KERNEL)
    if lib is None:
        return None
    if x.dtype != torch.float32 or x.dim() != 2 or x.device.type != "cpu":
        raise ValueError(f"x must be a 2-D fp32 CPU tensor; got {x.dtype} {tuple(x.shape)}")
    blocks, k, _ = packed.shape
    if x.shape[1] != k or not blocks * BLOCK_COLUMNS >= out_features > (blocks - 1) * BLOCK_COLUMNS:
        raise ValueError(f"x is [{x.shape[0]}, {x.shape[1]}]; the weight is [{out_features}, {k}]")
    if x.stride(1) != 1 or (x.shape[0] > 1 and x.stride(0) < k):
        x = x.contiguous()
    ldx = x.stride(0) if x.shape[0] > 1 else k  # (a single row's stride may be anything)
    fp16 = packed.dtype == torch.float16
    if bias is not None:
        bias = bias.detach().float().contiguous()
    y = torch.empty(x.shape[0], out_features, dtype=torch.float32)
    if x.shape[0] == 0:
        return y
    status = _bind(lib, portable)(
        x.data_ptr(),
        ldx,
        packed.data_ptr(),
        None if bias is None else bias.data_ptr(),
        y.data_ptr(),
        x.shape[0],
        out_features,
        k,
        int(fp16),
        torch.get_num_threads(),
    )
    if status != 0:
        raise ValueError(f"cpu_linear_w16: impossible sizes x {tuple(x.shape)}, out {out_features}")
    return y
