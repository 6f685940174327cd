"""Decoder projections with 16-bit weights multiplied in fp32 on the CPU
(``--quantization bf16`` / ``fp16``).

At load, every projection of the decoder layers (as ``--quantization int8`` chooses them) has
its fp32 weight rounded to bf16 or fp16 (to nearest even), laid out for
:mod:`pagedserve.kernels.cpu_linear_w16` and freed: half the weight memory, and half the bytes
a decode step streams. Activations, norms, attention, the KV cache, the embeddings and the LM
head stay fp32, so the only change to the model's arithmetic is the weights' rounding (fp16
keeps 10 bits of mantissa, bf16 7; a weight past fp16's 65,504 is refused at load).

This is the 16-bit mode for a CPU without bf16 or fp16 arithmetic, where a ``--dtype
bfloat16`` model is slower than fp32 (every torch matmul converts its operands), and the way
llama.cpp runs its F16 files there. Measured with ``bench.llamacpp_bench --f16`` (see
docs/benchmarks.md).
"""

from __future__ import annotations

import torch
from torch import Tensor

from pagedserve.kernels import cpu_linear_w16

__all__ = ["FP16_MAX", "HalfWeightLinear"]

FP16_MAX = 65504.0


class HalfWeightLinear:
    """A weight in 16 bits, laid out for the native kernel, and its fp32 matmul (the
    ``quantized`` slot of a :class:`Linear`)."""

    def __init__(self, weight: Tensor, bias: Tensor | None, fmt: str) -> None:
        self.packed = cpu_linear_w16.pack(weight.detach().float(), fmt)
        self.bias = None if bias is None else bias.detach().float().contiguous()
        self.out_features = weight.shape[0]

    def __call__(self, x: Tensor) -> Tensor:
        y = cpu_linear_w16.linear(x, self.packed, self.bias, self.out_features)
        if y is None:  # no native kernels here: the same values, widened on each call
            w = cpu_linear_w16.unpack(self.packed, self.out_features)
            y = torch.nn.functional.linear(x, w, self.bias)
        return y
