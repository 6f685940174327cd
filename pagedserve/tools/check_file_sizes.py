"""Lint: no Python file under ``services/`` or ``pagedserve/kernels/`` is longer than 500 lines
(a file that grows past it holds more than one concept: split it). Exits 1 naming the offenders."""

from __future__ import annotations

import sys
from pathlib import Path

MAX_LINES = 500
ROOTS = ("services", "pagedserve/kernels")


def oversized(root: Path, max_lines: int = MAX_LINES) -> list[tuple[Path, int]]:
    """``(file, lines)`` of every ``.py`` file under ``ROOTS`` of ``root`` over ``max_lines``."""
    found = []
    for top in ROOTS:
        for path in sorted((root / top).rglob("*.py")):
            n = len(path.read_text(encoding="utf-8").splitlines())
            if n > max_lines:
                found.append((path.relative_to(root), n))
    return found


def main() -> int:
    root = Path(__file__).resolve().parents[2]
    found = oversized(root)
    for path, n in found:
        print(f"{path}: {n} lines (at most {MAX_LINES})", file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
