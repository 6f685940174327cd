"""Per-test hypothesis example counts, scaled by the profile loaded (tests/conftest.py)."""

from __future__ import annotations

from hypothesis import settings

_CI_EXAMPLES = 100  # the ``ci`` profile's max_examples: counts are written for it


def examples(n: int) -> int:
    """``n`` examples under the ``ci`` profile; proportionally fewer or more under ``fast``
    and ``soak``, at least one."""
    return max(1, round(n * settings.default.max_examples / _CI_EXAMPLES))
