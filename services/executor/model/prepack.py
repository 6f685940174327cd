"""The decoder projections' fp32 weights packed once for oneDNN on the CPU.

Given a weight in torch's plain row-major layout, oneDNN's inner product reorders it into its
own blocked layout on every call; packed once at load (``mkldnn._reorder_linear_weight``),
the weight is read as it lies. Measured on this project's 2-core machine, the 0.4 B model's 64
projections (1.6 GB of fp32 weights streamed from memory a step), per step: 1 row 60.5 ms
plain against 66.2 packed, 4 rows 83.8 against 44.5, 16 rows 130 against 87, 64 rows 286
against 247 (MKL's sgemm: 98, 198, 240, 410). So every batch but a single sequence gains
(1.2-1.9x), and one sequence loses 9 % of its matmul time. The weights are packed for 16 rows;
the results are those of the plain oneDNN path up to fp32 rounding.

Packed: the :class:`~services.executor.model.layers.linear.Linear` layers inside the decoder
layers (q/k/v, o, gate/up, down; MoE routers), their plain weight freed (no memory is added).
Not packed: the embeddings and the LM head (the LM head may be the embedding table), LoRA
updates (added to the output as before), int8 layers (``--quantization int8`` packs its own),
other dtypes and devices, and anything when ``PAGEDSERVE_CPU_LINEAR=torch`` chooses MKL or
``PAGEDSERVE_CPU_PREPACK=0`` turns packing off (the plain oneDNN path: a baseline to measure).
"""

from __future__ import annotations

import os
from typing import Any

import structlog
import torch
from torch import Tensor

from pagedserve.kernels.cpu_linear import cpu_linear_impl
from services.executor.model.layers.linear import plain_projections
from services.executor.model.models import DecoderLM

__all__ = ["PACK_ROWS", "PREPACK_ENV", "PackedLinear", "prepack_model"]

log = structlog.get_logger(__name__)

PREPACK_ENV = "PAGEDSERVE_CPU_PREPACK"
PACK_ROWS = 16  # the row count oneDNN's layout is chosen for (measured best from 4 to 2,048)


class PackedLinear:
    """A weight in oneDNN's layout and its matmul (the ``quantized`` slot of a
    :class:`Linear`: the layer calls it instead of its plain weight)."""

    def __init__(self, weight: Tensor, bias: Tensor | None) -> None:
        self.packed: Any = torch.ops.mkldnn._reorder_linear_weight(
            weight.detach().contiguous(), PACK_ROWS
        )
        self.bias = None if bias is None else bias.detach().contiguous()
        self.out_features = weight.shape[0]

    def __call__(self, x: Tensor) -> Tensor:
        if x.shape[0] == 0:
            return x.new_zeros(0, self.out_features)
        return torch.ops.mkldnn._linear_pointwise(
            x.contiguous(), self.packed, self.bias, "none", [], ""
        )


def can_prepack(model: DecoderLM) -> bool:
    """Whether ``model``'s projections run through oneDNN in fp32 on the CPU."""
    device = next(model.parameters()).device
    return (
        os.environ.get(PREPACK_ENV, "1") != "0"
        and device.type == "cpu"
        and model.dtype == torch.float32
        and cpu_linear_impl() == "onednn"
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


def prepack_model(model: DecoderLM) -> int:
    """Pack ``model``'s decoder projections (see the module docstring); returns how many."""
    if not can_prepack(model):
        return 0
    projections = plain_projections(model.layers)
    for module in projections:
        module.replace_weight(PackedLinear(module.weight, module.bias))
    log.info("model_prepacked", layers=len(projections), rows=PACK_ROWS)
    return len(projections)
