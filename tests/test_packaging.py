"""The repository's top-level packages shadow no other distribution's modules. A package at the
root is importable from the root (as the tests and ``pagedserve serve`` run) and ships as a
top-level module: one named like another distribution's (this repository's ``kernels`` once
was, and transformers 5.25 requires Hugging Face's ``kernels``) breaks whoever imports that."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_no_top_level_package_is_another_distributions_module() -> None:
    owners = importlib.metadata.packages_distributions()
    ours = sorted(p.parent.name for p in ROOT.glob("*/__init__.py"))
    assert "pagedserve" in ours and "services" in ours
    clashes = {
        name: sorted(set(owners[name]) - {"pagedserve"})
        for name in ours
        if set(owners.get(name, ())) - {"pagedserve"}
    }
    assert not clashes, f"top-level packages that other distributions also ship: {clashes}"
