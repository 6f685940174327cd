"""The adapters of one forward, applied row by row: each projection's LoRA slot table and the
per-forward map of which rows use which slot.

A projection with LoRA holds ``a [S, P*R, in]`` and ``b [S, out, P*R]``: for each of the
``S`` device slots, its ``P`` parts (q, k, v of ``qkv_proj``; gate, up of ``gate_up_proj``)
each padded to the max rank ``R`` with zeros. A row of slot ``s`` adds
``(x @ a[s].T) @ b[s].T`` to the base projection's output; the zero padding adds exactly
nothing, so one shrink and one expand serve every part. On the CPU the rows of each adapter
go through two matmuls when they are contiguous (a prefill), else every adapter's rows
through two batched matmuls over the slots (decode batches interleave them); on CUDA the
Punica shrink / expand kernels take a per-row slot index.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from pagedserve.kernels import ops

__all__ = ["LoRABatched", "LoRAContext", "LoRAGroup", "LoRAMapping", "LoRAProjection"]


@dataclass(frozen=True)
class LoRAGroup:
    """The rows of the one adapter of a forward: a slice of the token axis, in ``slot``."""

    slot: int
    rows: slice


@dataclass(frozen=True)
class LoRABatched:
    """The rows of several adapters as one batched matmul (CPU): the ``G`` slots of ``slots``
    (a slice of the slot table when they are consecutive, else their indices) each get ``M``
    rows. Either rows ``[start, start + G*M)`` are exactly those, each slot's ``M`` in turn
    (``gather`` None: no index op at all; the scheduler groups a batch's rows by adapter), or
    ``gather`` ``[G*M]`` picks them (fillers repeat row 0), and the results at ``valid`` (the
    real rows' positions; None: all) are added to token rows ``dest``."""

    slots: slice | Tensor  # [G] the slots in use, in row order
    num_groups: int  # G
    num_rows: int  # M
    start: int = 0
    gather: Tensor | None = None  # [G * M] int64
    valid: Tensor | None = None  # [N] int64
    dest: Tensor | None = None  # [N] int64


@dataclass(frozen=True)
class LoRAMapping:
    """Which token rows of a forward use which slot (rows of the base model in none): on CUDA
    a slot per row (``token_slots``, the kernels' input); on the CPU one adapter's contiguous
    rows (``group``), or several adapters' rows as one batched matmul over their slots
    (``batched``): a few ops per projection whatever the number of adapters. None of them: no
    row uses an adapter."""

    group: LoRAGroup | None = None
    batched: LoRABatched | None = None
    token_slots: Tensor | None = None  # [T] int32, -1 for base rows
    num_adapters: int = 0  # the adapters (slots) its rows use

    @property
    def empty(self) -> bool:
        return self.num_adapters == 0


@dataclass
class LoRAContext:
    """Shared by every projection with LoRA: the mapping of the forward running now (set by
    the runner before it, empty when no row uses an adapter)."""

    mapping: LoRAMapping = field(default_factory=LoRAMapping)


class LoRAProjection:
    """One projection's slot table and its row-wise update (duck-typed as the ``lora``
    attribute of :class:`~services.executor.model.layers.linear.Linear`)."""

    def __init__(
        self,
        context: LoRAContext,
        num_slots: int,
        num_parts: int,
        max_rank: int,
        in_features: int,
        out_features: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        self.context = context
        self.max_rank = max_rank
        width = num_parts * max_rank
        self.a = torch.zeros(num_slots, width, in_features, dtype=dtype, device=device)
        self.b = torch.zeros(num_slots, out_features, width, dtype=dtype, device=device)

    def add_to(self, x: Tensor, y: Tensor) -> None:
        """``y[rows of slot s] += x[rows] @ a[s].T @ b[s].T`` for each slot of the mapping."""
        mapping = self.context.mapping
        if mapping.token_slots is not None:
            shrunk = ops.lora_shrink(x, self.a, mapping.token_slots)
            ops.lora_expand(shrunk, self.b, mapping.token_slots, y)
            return
        group, batched = mapping.group, mapping.batched
        if group is not None:
            rows = group.rows
            y[rows] += ops.linear(ops.linear(x[rows], self.a[group.slot]), self.b[group.slot])
            return
        if batched is None:
            return
        slots = batched.slots
        if isinstance(slots, slice):  # a view of the slot table
            a, b = self.a[slots], self.b[slots]
        else:
            a, b = self.a.index_select(0, slots), self.b.index_select(0, slots)
        g, m, gather = batched.num_groups, batched.num_rows, batched.gather
        if gather is None:
            rows = slice(batched.start, batched.start + g * m)
            y[rows] += torch.bmm(torch.bmm(x[rows].view(g, m, -1), a.mT), b.mT).view(g * m, -1)
            return
        xs = x.index_select(0, gather).view(g, m, -1)
        ys = torch.bmm(torch.bmm(xs, a.mT), b.mT).view(g * m, -1)  # [G * M, out]
        if batched.valid is not None:
            ys = ys.index_select(0, batched.valid)
        assert batched.dest is not None
        y.index_add_(0, batched.dest, ys)

    def clear(self, slot: int) -> None:
        self.a[slot].zero_()
        self.b[slot].zero_()
