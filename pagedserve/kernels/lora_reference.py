"""Torch reference of the multi-LoRA ops: the test oracle of the Triton kernels
(:mod:`pagedserve.kernels.lora_triton`) and the path :mod:`pagedserve.kernels.ops` serves
for CPU tensors.

Multi-LoRA serving applies each token row's own adapter: ``y[t] += (x[t] @ A[slot[t]].T)
@ B[slot[t]].T``. The adapters live in a slot table of ``S`` slots padded to a max rank
``R`` with zeros; ``slot[t] = -1`` means "no adapter" and leaves the row untouched. The
product runs as two ops, as in vLLM's Punica kernels:

- :func:`lora_shrink_ref` ``(x [T, K], a [S, R, K], token_slots [T]) -> [T, R]`` fp32:
  ``x[t] @ a[slot[t]].T`` accumulated in fp32; rows with slot ``-1`` are zero.
- :func:`lora_expand_ref` ``(s [T, R] fp32, b [S, N, R], token_slots [T], y [T, N])``:
  ``y[t] = to_dtype(y[t] + s[t] @ b[slot[t]].T)`` in place (the sum in fp32, rounded once
  to ``y.dtype``) for rows with slot ``>= 0``; the other rows are not written. ``b`` holds
  ``lora_B`` with the adapter's scaling already folded in.

The reference loops over the slots that some row uses (one fp32 matmul per slot on the
rows of that slot), so it reads the device on the host (``unique``, boolean indexing): it is
an oracle and a CPU path, not a CUDA-graph path.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = [
    "check_lora_expand_shapes",
    "check_lora_shrink_shapes",
    "lora_expand_ref",
    "lora_shrink_ref",
]


def _check_slots(op: str, token_slots: Tensor, num_tokens: int, device: torch.device) -> None:
    if (
        token_slots.dim() != 1
        or token_slots.shape[0] != num_tokens
        or token_slots.dtype not in (torch.int32, torch.int64)
        or token_slots.device != device
    ):
        raise ValueError(
            f"{op}: token_slots must be [T] = [{num_tokens}] int32/int64 on {device}, got "
            f"{tuple(token_slots.shape)} {token_slots.dtype} on {token_slots.device}"
        )


def check_lora_shrink_shapes(x: Tensor, a: Tensor, token_slots: Tensor) -> None:
    """Raise ``ValueError`` unless ``x [T, K]``, ``a [S, R, K]`` (same dtype and device, a
    float dtype) and ``token_slots [T]`` fit the contract of :func:`lora_shrink_ref`."""
    ok = (
        x.dim() == 2
        and a.dim() == 3
        and a.shape[2] == x.shape[1]
        and a.dtype == x.dtype
        and x.is_floating_point()
        and a.device == x.device
    )
    if not ok:
        raise ValueError(
            f"lora_shrink: need x [T, K] and a [S, R, K] of one float dtype on one device, got "
            f"x {tuple(x.shape)} {x.dtype} on {x.device}, a {tuple(a.shape)} {a.dtype} on "
            f"{a.device}"
        )
    _check_slots("lora_shrink", token_slots, x.shape[0], x.device)


def check_lora_expand_shapes(s: Tensor, b: Tensor, token_slots: Tensor, y: Tensor) -> None:
    """Raise ``ValueError`` unless ``s [T, R]`` fp32, ``b [S, N, R]`` and ``y [T, N]`` (float
    dtypes, one device) and ``token_slots [T]`` fit the contract of :func:`lora_expand_ref`."""
    ok = (
        s.dim() == 2
        and b.dim() == 3
        and y.dim() == 2
        and s.dtype == torch.float32
        and b.is_floating_point()
        and y.is_floating_point()
        and b.shape[2] == s.shape[1]
        and y.shape == (s.shape[0], b.shape[1])
        and b.device == s.device == y.device
    )
    if not ok:
        raise ValueError(
            f"lora_expand: need s [T, R] fp32, b [S, N, R] and y [T, N] on one device, got "
            f"s {tuple(s.shape)} {s.dtype}, b {tuple(b.shape)} {b.dtype}, "
            f"y {tuple(y.shape)} {y.dtype}"
        )
    _check_slots("lora_expand", token_slots, s.shape[0], s.device)


def _rows_by_slot(token_slots: Tensor) -> list[tuple[int, Tensor]]:
    """``(slot, rows)`` for every slot that some row uses, in increasing slot order."""
    slots = token_slots.to(torch.int64)
    used = torch.unique(slots[slots >= 0]).tolist()
    return [(slot, torch.nonzero(slots == slot).flatten()) for slot in used]


def lora_shrink_ref(
    x: Tensor,  # [T, K]
    a: Tensor,  # [S, R, K]
    token_slots: Tensor,  # [T] int, in [-1, S)
) -> Tensor:  # [T, R] fp32
    """``out[t] = x[t] @ a[token_slots[t]].T`` in fp32; zero where ``token_slots[t] == -1``."""
    check_lora_shrink_shapes(x, a, token_slots)
    out = torch.zeros(x.shape[0], a.shape[1], dtype=torch.float32, device=x.device)
    for slot, rows in _rows_by_slot(token_slots):
        out[rows] = x[rows].float() @ a[slot].float().T
    return out


def lora_expand_ref(
    s: Tensor,  # [T, R] fp32
    b: Tensor,  # [S, N, R]
    token_slots: Tensor,  # [T] int, in [-1, S)
    y: Tensor,  # [T, N], updated in place
) -> None:
    """``y[t] = to_dtype(y[t] + s[t] @ b[token_slots[t]].T)`` in place, the sum in fp32; rows
    with ``token_slots[t] == -1`` are not written."""
    check_lora_expand_shapes(s, b, token_slots, y)
    for slot, rows in _rows_by_slot(token_slots):
        delta = s[rows] @ b[slot].float().T
        y[rows] = (y[rows].float() + delta).to(y.dtype)
