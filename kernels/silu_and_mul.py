"""Triton kernel: SwiGLU's ``silu(gate) * up`` over the fused gate/up projection output.

Grid ``(T, cdiv(I, BLOCK))``: each program reads ``BLOCK`` columns of the gate half and the
up half of one row of ``x = [gate | up]`` and writes ``to_dtype(to_dtype(silu(gate)) * up)``
in fp32 arithmetic: the roundings of ``F.silu(gate) * up`` in the model dtype.
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

__all__ = ["silu_and_mul_triton"]

_BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,  # [T, 2I]
    out_ptr,  # [T, I]
    inter,
    stride_x,
    stride_o,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + inter + offs, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (act * up.to(tl.float32)).to(gate.dtype), mask=mask)


def silu_and_mul_triton(x: Tensor) -> Tensor:  # [T, 2I] -> [T, I]
    """Triton ``silu_and_mul``; contract of :func:`kernels.reference.silu_and_mul`."""
    if x.dim() != 2 or x.shape[1] % 2 or x.stride(-1) != 1:
        raise ValueError(
            f"silu_and_mul: x must be [T, 2I] with stride(-1) == 1, got "
            f"{tuple(x.shape)} strides {x.stride()}"
        )
    num_tokens, inter = x.shape[0], x.shape[1] // 2
    out = x.new_empty(num_tokens, inter)
    if num_tokens == 0:
        return out
    block = min(_BLOCK, triton.next_power_of_2(inter))
    grid = (num_tokens, triton.cdiv(inter, block))
    _silu_and_mul_kernel[grid](x, out, inter, x.stride(0), out.stride(0), BLOCK=block)
    return out
