"""Statistics of the benchmarks' samples: one percentile definition for all of them."""

from __future__ import annotations

import statistics
from collections.abc import Sequence

__all__ = ["median", "percentile", "spread"]


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs)


def percentile(xs: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0..1) by nearest rank from above: ``sorted(xs)[int(q * n)]``, the
    largest sample for ``q = 1``."""
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def spread(xs: Sequence[float], fmt: str = "{:.1f}") -> str:
    """``median (min-max)`` of ``xs`` (just the value for one sample)."""
    if len(xs) == 1:
        return fmt.format(xs[0])
    return f"{fmt.format(median(xs))} ({fmt.format(min(xs))}-{fmt.format(max(xs))})"
