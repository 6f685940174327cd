"""Triton kernel: residual add + RMSNorm in one pass over the hidden state.

Grid ``(T,)``: one program per token row. With a residual, ``r = x + residual`` is rounded to
the model dtype and written to ``residual`` in place (the next layer's residual), then
normalised: ``out = weight * to_dtype(r * rsqrt(mean(r^2) + eps))`` (Gemma's ``unit_offset``:
``to_dtype(r * rsqrt(mean(r^2) + eps) * (1 + weight))``), all arithmetic in fp32
and each rounding where HF's two-op form rounds, so only the order of the mean's sum
differs from :func:`pagedserve.kernels.reference.fused_add_rms_norm`.
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

__all__ = ["fused_add_rms_norm_triton"]


@triton.jit
def _add_rms_norm_kernel(
    x_ptr,  # [T, H]
    residual_ptr,  # [T, H], read and written (unused without HAS_RESIDUAL)
    weight_ptr,  # [H]
    out_ptr,  # [T, H]
    hidden,
    stride_x,
    stride_r,
    stride_o,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    UNIT_OFFSET: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < hidden
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(residual_ptr + row * stride_r + offs, x, mask=mask)
    x32 = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x32 * x32, axis=0) / hidden + eps)
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if UNIT_OFFSET:  # Gemma: the (1 + w) gain in fp32, one rounding
        out = (x32 * rstd * (1.0 + w)).to(x.dtype)
    else:  # Llama: normalised, rounded, then scaled
        out = ((x32 * rstd).to(x.dtype).to(tl.float32) * w).to(x.dtype)
    tl.store(out_ptr + row * stride_o + offs, out, mask=mask)


def fused_add_rms_norm_triton(
    x: Tensor,  # [T, H]
    residual: Tensor | None,  # [T, H], updated in place to x + residual
    weight: Tensor,  # [H]
    eps: float,
    unit_offset: bool = False,
) -> Tensor:  # [T, H]
    """Triton ``fused_add_rms_norm``; contract of :func:`.reference.fused_add_rms_norm`."""
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(
            f"fused_add_rms_norm: x must be [T, H] with stride(-1) == 1, got "
            f"{tuple(x.shape)} strides {x.stride()}"
        )
    num_tokens, hidden = x.shape
    if weight.shape != (hidden,):
        raise ValueError(f"fused_add_rms_norm: weight {tuple(weight.shape)} != ({hidden},)")
    if residual is not None and (residual.shape != x.shape or residual.stride(-1) != 1):
        raise ValueError(
            f"fused_add_rms_norm: residual {tuple(residual.shape)} != x "
            f"{tuple(x.shape)} or not contiguous in H"
        )
    out = x.new_empty(num_tokens, hidden)
    if num_tokens == 0:
        return out
    block = triton.next_power_of_2(hidden)
    _add_rms_norm_kernel[(num_tokens,)](
        x,
        residual if residual is not None else x,
        weight,
        out,
        hidden,
        x.stride(0),
        residual.stride(0) if residual is not None else 0,
        out.stride(0),
        eps,
        HAS_RESIDUAL=residual is not None,
        UNIT_OFFSET=unit_offset,
        BLOCK=block,
        num_warps=min(max(block // 256, 1), 16),
    )
    return out
