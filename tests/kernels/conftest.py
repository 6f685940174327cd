"""Fixtures for the kernel tests.

Without CUDA the Triton kernels run under the interpreter (``TRITON_INTERPRET=1``, set by
``tests/conftest.py`` before triton is imported); bf16 is not faithful there, so CPU
tests use fp32 and fp16 and bf16 is covered by ``@pytest.mark.gpu`` tests. Case matrices
and tolerances live in :mod:`pagedserve.kernels.testing` (shared with
``bench.internals.gpu_check``).
"""

from __future__ import annotations

import pytest


@pytest.fixture
def force_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make ``pagedserve.kernels.ops`` dispatch to Triton even for CPU tensors (interpreter)."""
    monkeypatch.setenv("PAGEDSERVE_FORCE_TRITON", "1")
