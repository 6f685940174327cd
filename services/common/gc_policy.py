"""The garbage-collector policy of a serving process, applied once it has started.

Every step allocates a few thousand short-lived containers (outputs, chunk tuples, op lists);
with CPython's defaults the young generation is collected about once per decode step, and a
full collection walks every object loaded at start-up (the model, torch, grpc): 30-50 ms
pauses in the host bench. So, as vLLM does after warm-up (``freeze_gc_heap``):

- collect once, then freeze: start-up objects move to the permanent generation, which no
  collection walks;
- collect the young generation less often (threshold 700 -> ``GEN0_THRESHOLD``): each
  collection then finds mostly dead objects, so the total cost falls with the count.

Cyclic garbage is still collected; memory kept a little longer is bounded by the threshold.
"""

from __future__ import annotations

import gc

__all__ = ["GEN0_THRESHOLD", "freeze_startup_heap"]

GEN0_THRESHOLD = 20_000


def freeze_startup_heap() -> int:
    """Apply the policy; returns the number of objects frozen."""
    gc.collect()
    gc.freeze()
    _, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(GEN0_THRESHOLD, gen1, gen2)
    return gc.get_freeze_count()
