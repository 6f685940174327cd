"""Triton kernels: the gated MLP's ``act(gate) * up`` over the fused gate/up projection
output, with SiLU (SwiGLU) or tanh-approximated GELU (GeGLU, Gemma).

Grid ``(T, cdiv(I, BLOCK))``: each program reads ``BLOCK`` columns of the gate half and the
up half of one row of ``x = [gate | up]`` and writes ``to_dtype(to_dtype(act(gate)) * up)``
in fp32 arithmetic: the roundings of ``F.silu(gate) * up`` (``F.gelu(gate, approximate=
"tanh") * up``) in the model dtype.
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

__all__ = ["gelu_tanh_and_mul_triton", "silu_and_mul_triton"]

_BLOCK = 1024
_SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)  # a jit global must be a constexpr


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,  # [T, 2I]
    out_ptr,  # [T, I]
    inter,
    stride_x,
    stride_o,
    GELU_TANH: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + inter + offs, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    if GELU_TANH:
        inner = _SQRT_2_OVER_PI * (g + 0.044715 * g * g * g)
        tanh = 1.0 - 2.0 / (tl.exp(2.0 * inner) + 1.0)  # saturates to +-1, never NaN
        act = (0.5 * g * (1.0 + tanh)).to(gate.dtype).to(tl.float32)
    else:
        act = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (act * up.to(tl.float32)).to(gate.dtype), mask=mask)


def silu_and_mul_triton(x: Tensor) -> Tensor:  # [T, 2I] -> [T, I]
    """Triton ``silu_and_mul``; contract of :func:`pagedserve.kernels.reference.silu_and_mul`."""
    return _act_and_mul(x, gelu_tanh=False, name="silu_and_mul")


def gelu_tanh_and_mul_triton(x: Tensor) -> Tensor:  # [T, 2I] -> [T, I]
    """Triton ``gelu_tanh_and_mul``; contract of :func:`.reference.gelu_tanh_and_mul`."""
    return _act_and_mul(x, gelu_tanh=True, name="gelu_tanh_and_mul")


def _act_and_mul(x: Tensor, *, gelu_tanh: bool, name: str) -> Tensor:
    if x.dim() != 2 or x.shape[1] % 2 or x.stride(-1) != 1:
        raise ValueError(
            f"{name}: x must be [T, 2I] with stride(-1) == 1, got "
            f"{tuple(x.shape)} strides {x.stride()}"
        )
    num_tokens, inter = x.shape[0], x.shape[1] // 2
    out = x.new_empty(num_tokens, inter)
    if num_tokens == 0:
        return out
    block = min(_BLOCK, triton.next_power_of_2(inter))
    grid = (num_tokens, triton.cdiv(inter, block))
    _silu_and_mul_kernel[grid](
        x, out, inter, x.stride(0), out.stride(0), GELU_TANH=gelu_tanh, BLOCK=block
    )
    return out
