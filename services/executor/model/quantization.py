"""Quantized linear layers on the CPU: int8 (``--quantization int8``, below) and 16-bit weights
(``bf16``, ``fp16``: :mod:`services.executor.model.half_weights`).

At load, every projection of the decoder layers (q/k/v, o, gate/up, down: the model's
:class:`~services.executor.model.layers.linear.Linear` inside its layers) is quantized: its
weight to int8 with one scale per output row (symmetric, ``max |w| / 127``, computed from the
checkpoint's weights), packed once for oneDNN's int8 inner product, and its fp32 weight freed.
Each forward quantizes the layer's input dynamically, one scale per row (each row is divided
by its max ``|x|`` first, so that the op's single activation scale fits every row, and
multiplied back after), multiplies in int8 with int32 accumulation and returns fp32: torch's
``quantized::linear_dynamic``, on the oneDNN engine where torch has it.

Measured before choosing (``bench.cpu_bench --quantization int8``; docs/benchmarks.md): on this
machine oneDNN's dynamic int8 ran the CPU model's projections 3-11x faster than the fp32
oneDNN path at 1-512 rows, where weight-only int8 (``torch._weight_int8pack_mm``, fp32
activations) ran 4-50x *slower*. The price is the activations' rounding: logits move by about
1 % of their range (tested), enough to flip a near-tie of a random model's greedy tokens.

Not quantized: the embeddings, the LM head (the logits keep fp32), MoE routers and experts
(the fused MoE path), draft models and EAGLE heads. CPU and fp32 only. torch has deprecated
its quantized tensors (pytorch/pytorch#184982), which the packing goes through: when they are
removed, this moves to torchao's int8 dynamic-activation kernels.
"""

from __future__ import annotations

import warnings
from typing import Any

import structlog
import torch
from torch import Tensor

from pagedserve.kernels import cpu_native
from services.executor.model.errors import ModelLoadError
from services.executor.model.half_weights import FP16_MAX, HalfWeightLinear
from services.executor.model.layers.linear import Linear, plain_projections
from services.executor.model.models import DecoderLM
from services.executor.model.runner_config import QUANTIZATION_METHODS

__all__ = ["QUANTIZATION_METHODS", "HalfWeightLinear", "Int8Linear", "quantize_model"]

log = structlog.get_logger(__name__)

_ENGINES = ("onednn", "x86", "fbgemm")  # by measured speed on this project's CPU


class Int8Linear:
    """A packed int8 weight (per-row scales) and its dynamic-activation matmul (the
    ``quantized`` attribute of a :class:`Linear`)."""

    def __init__(self, weight: Tensor, bias: Tensor | None) -> None:
        w = weight.detach().float()
        scales = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-12).double()
        zero_points = torch.zeros(w.shape[0], dtype=torch.int64)
        with warnings.catch_warnings():  # (torch's quantized tensors are deprecated: below)
            warnings.simplefilter("ignore", UserWarning)
            qweight = torch.quantize_per_channel(w, scales, zero_points, 0, torch.qint8)
        self.packed: Any = torch.ops.quantized.linear_prepack(qweight, None)
        self.bias = None if bias is None else bias.detach().float()
        self.out_features = w.shape[0]

    def __call__(self, x: Tensor) -> Tensor:
        if x.shape[0] == 0:
            return x.new_zeros(0, self.out_features)
        # Each row scaled to a max |x| of 1 first: the op's one activation scale then fits
        # every row (per-token quantization), and the rows' scales are multiplied back after.
        row_max = x.abs().amax(dim=1, keepdim=True).clamp_min_(1e-12)
        y = torch.ops.quantized.linear_dynamic((x / row_max).contiguous(), self.packed, False)
        y.mul_(row_max)
        if self.bias is not None:
            y.add_(self.bias)
        return y


def quantize_model(model: DecoderLM, method: str) -> int:
    """Quantize ``model``'s decoder projections by ``method``; returns how many. A model it
    cannot serve is a :class:`ModelLoadError` naming the flag."""
    if method not in QUANTIZATION_METHODS:
        raise ModelLoadError(f"--quantization {method!r}: choose one of {QUANTIZATION_METHODS}")
    device = next(model.parameters()).device
    if device.type != "cpu" or model.dtype != torch.float32:
        raise ModelLoadError(
            f"--quantization {method}: these layers run on the CPU in float32 (this model is "
            f"{model.dtype} on {device}); drop the flag or use --device cpu --dtype float32"
        )
    projections = plain_projections(model.layers)
    before = sum(m.weight.numel() * m.weight.element_size() for m in projections)
    after = sum(m.weight.numel() for m in projections) * (1 if method == "int8" else 2)
    if method == "int8":
        engine = _int8_engine()
        for module in projections:
            module.replace_weight(Int8Linear(module.weight, module.bias))
    else:
        engine = "native" if cpu_native.load("cpu_linear_w16") is not None else "torch"
        if engine == "torch":
            log.warning("half_weights_without_native_kernel", detail="widened on every call")
        if method == "fp16":
            _check_fp16_range(projections)
        for module in projections:
            module.replace_weight(HalfWeightLinear(module.weight, module.bias, method))
    log.info(
        "model_quantized",
        method=method,
        engine=engine,
        layers=len(projections),
        weight_bytes_before=before,
        weight_bytes_after=after,
    )
    return len(projections)


def _int8_engine() -> str:
    engines = torch.backends.quantized.supported_engines
    engine = next((e for e in _ENGINES if e in engines), None)
    if engine is None:
        raise ModelLoadError("--quantization int8: this torch has no int8 CPU engine")
    torch.backends.quantized.engine = engine  # (the packing picks the kernels)
    return engine


def _check_fp16_range(projections: list[Linear]) -> None:
    for module in projections:
        largest = float(module.weight.detach().abs().max())
        if largest > FP16_MAX:
            raise ModelLoadError(
                f"--quantization fp16: a projection weight reaches {largest:g}, past fp16's "
                f"{FP16_MAX:g}; use --quantization bf16"
            )
