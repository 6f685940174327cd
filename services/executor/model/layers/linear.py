"""Linear layers and tensor-parallel pieces: the linear layer of every projection, the
vocabulary-parallel embedding, and where a checkpoint tensor (or the slice of it that this
rank holds) goes in a parameter."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from pagedserve.kernels import ops
from services.executor.model.parallel import Comm, ShardPlan

__all__ = ["Linear", "Placement", "VocabParallelEmbedding", "plain_projections", "tensor_shape"]


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters, same checkpoint names) computed by
    :func:`pagedserve.kernels.ops.linear`: oneDNN for fp32 on the CPU, or with
    ``--quantization int8`` its ``quantized`` int8 weight. With multi-LoRA
    serving, ``lora`` (a :class:`~services.executor.model.lora.layer.LoRAProjection`) adds
    each row's adapter to the output, before any all-reduce."""

    lora: Any = None
    quantized: Any = None  # an int8 weight and its matmul (model/quantization.py), if any

    def replace_weight(self, kernel: Any) -> None:
        """Compute with ``kernel`` (called with the input) from now on; the plain weight is
        freed."""
        self.quantized = kernel
        self.weight = nn.Parameter(torch.empty(0, dtype=self.weight.dtype), requires_grad=False)

    def forward(self, x: Tensor) -> Tensor:
        q = self.quantized
        y = ops.linear(x, self.weight, self.bias) if q is None else q(x)
        if self.lora is not None:
            self.lora.add_to(x, y)
        return y


def plain_projections(layers: Iterable[nn.Module]) -> list[Linear]:
    """The :class:`Linear` layers inside ``layers`` that still compute with a plain weight."""
    return [
        m
        for layer in layers
        for m in layer.modules()
        if isinstance(m, Linear) and m.quantized is None and m.weight.numel()
    ]


class VocabParallelEmbedding(nn.Module):
    """The embedding table's rows ``[vocab_start, vocab_start + vocab_rows)`` on this rank;
    tokens outside them look up zeros, and the all-reduce adds the owning rank's row."""

    def __init__(self, shard: ShardPlan, hidden_size: int, dtype: torch.dtype, comm: Comm) -> None:
        super().__init__()
        self.start, self.num_rows, self.comm = shard.vocab_start, shard.vocab_rows, comm
        self.weight = nn.Parameter(torch.empty(shard.vocab_rows, hidden_size, dtype=dtype))

    def forward(self, ids: Tensor) -> Tensor:  # [T] -> [T, H]
        if self.comm.size == 1:
            return nn.functional.embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.num_rows)
        h = nn.functional.embedding(local.masked_fill(outside, 0), self.weight)
        return self.comm.all_reduce(h.masked_fill_(outside[:, None], 0))


@dataclass(frozen=True)
class Placement:
    """Where a checkpoint tensor goes on this rank: the parameter region it fills, and the
    slice of the checkpoint tensor that fills it (along ``dim``, from ``start``; ``total``
    is that dimension's extent in a valid checkpoint). ``dim=None``: the whole tensor."""

    target: Tensor
    dim: int | None = None
    start: int = 0
    total: int = 0
    copy: bool = True  # false: shape-checked only (a row-parallel bias off rank 0 stays 0)


def tensor_shape(weight: Any) -> tuple[int, ...]:
    """The shape of a tensor or of a safetensors slice (read without loading it)."""
    return tuple(weight.shape) if isinstance(weight, Tensor) else tuple(weight.get_shape())
