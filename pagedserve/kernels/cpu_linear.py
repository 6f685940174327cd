"""Linear layers on the CPU through oneDNN.

``torch.nn.functional.linear`` runs an fp32 matmul on the CPU through MKL's sgemm. On the
AMD EPYC (AVX-512) machine this project measures on, oneDNN's inner product
(``torch.ops.mkldnn._linear_pointwise``, which torch's CPU compiler emits for linear layers
with dynamic shapes) ran the model's shapes 2.0-2.6x faster: hidden 512 to 2048 at 64 rows,
124 against 276 GFLOP/s; at 2,048 rows, 175 against 366. MKL is known to take slower paths
on non-Intel CPUs, so the gain may be smaller on Intel (not measured there);
``PAGEDSERVE_CPU_LINEAR=torch`` restores MKL. A row count oneDNN has not seen yet costs
0.2-1 ms more on its first call (a primitive is built and cached). The results are fp32
sums in another order (differences of the order of fp32 rounding, as between any two BLAS
libraries).

Only fp32 goes there: torch already sends bf16 to oneDNN, and oneDNN has no fp16 inner
product on most CPUs. Where torch was built without oneDNN, or
``PAGEDSERVE_CPU_LINEAR=torch``, every linear is ``torch.nn.functional.linear``.
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["CPU_LINEAR_ENV", "cpu_linear", "cpu_linear_impl"]

CPU_LINEAR_ENV = "PAGEDSERVE_CPU_LINEAR"
_IMPLS = ("onednn", "torch")


def cpu_linear_impl() -> str:
    """The matmul serving fp32 CPU linear layers: ``onednn`` (default, where torch has it)
    or ``torch``."""
    name = os.environ.get(CPU_LINEAR_ENV, "onednn") or "onednn"
    if name not in _IMPLS:
        raise ValueError(f"{CPU_LINEAR_ENV}={name!r}: choose one of {sorted(_IMPLS)}")
    if name == "onednn" and not _has_onednn():
        return "torch"
    return name


@functools.cache
def _has_onednn() -> bool:
    return bool(torch.backends.mkldnn.is_available())


def cpu_linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """``x @ weight.T + bias`` for CPU tensors, as ``torch.nn.functional.linear``."""
    if x.dtype == torch.float32 and cpu_linear_impl() == "onednn":
        # oneDNN reads the bias as a packed array: a strided view would be misread.
        packed = bias.contiguous() if bias is not None else None
        return torch.ops.mkldnn._linear_pointwise(x, weight, packed, "none", [], "")
    return F.linear(x, weight, bias)
