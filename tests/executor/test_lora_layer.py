"""The CPU row-wise LoRA update equals the per-row formula ``y[t] += x[t] @ A[s].T @ B[s].T``
whatever the rows' layout: one adapter on a slice, adapters grouped in equal contiguous runs
(no index op), interleaved, of unequal sizes, with base rows between, on some slots only."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from services.executor.model.lora.layer import LoRAContext, LoRAProjection
from services.executor.model.lora.slots import LoRASlots

LAYOUTS = {
    "one adapter": [0, 0, 1, 1, 1, 1, 0],
    "equal runs in slot order": [1, 1, 2, 2, 3, 3, 4, 4],
    "equal runs after base rows": [0, 0, 0, 2, 2, 1, 1],
    "interleaved": [1, 2, 3, 1, 2, 3, 1, 2],
    "unequal with base rows": [0, 3, 3, 3, 0, 1, 2, 2, 0],
    "one slot of four": [0, 4, 0, 4],
}


def _slots(num_slots: int) -> LoRASlots:
    """A slot table without a model: the mapping's logic only (ids 1..4 in slots 0..3)."""
    slots = LoRASlots.__new__(LoRASlots)
    slots.num_slots, slots.device = num_slots, torch.device("cpu")
    slots._slots = {i + 1: i for i in range(num_slots)}  # type: ignore[assignment]
    return slots


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("num_slots", [4, 6])
def test_the_rows_get_their_own_adapter_whatever_the_layout(layout: str, num_slots: int) -> None:
    rows = np.array(LAYOUTS[layout])
    gen = torch.Generator().manual_seed(0)
    context = LoRAContext()
    projection = LoRAProjection(context, num_slots, 2, 4, 16, 12, torch.float32, "cpu")
    projection.a.copy_(torch.randn(projection.a.shape, generator=gen))
    projection.b.copy_(torch.randn(projection.b.shape, generator=gen))
    x = torch.randn(len(rows), 16, generator=gen)
    wanted = sorted(int(i) for i in set(rows.tolist()) - {0})
    context.mapping = _slots(num_slots)._mapping(rows, wanted)
    y = torch.zeros(len(rows), 12)
    projection.add_to(x, y)
    for t, adapter in enumerate(rows.tolist()):
        s = adapter - 1
        expected = (x[t] @ projection.a[s].T) @ projection.b[s].T if adapter else torch.zeros(12)
        torch.testing.assert_close(y[t], expected, rtol=1e-5, atol=1e-5)
    assert context.mapping.num_adapters == len(wanted)
