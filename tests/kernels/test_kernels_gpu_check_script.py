"""``bench.internals.gpu_check`` works before it meets a GPU.

The script cannot be run for real here, so its every code path is exercised by its
``--cpu-dry-run`` mode (Triton interpreter, tiny shapes), and its CPU-only exit path is
checked as CI sees it.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[2]
SCRIPT = "bench.internals.gpu_check"


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", SCRIPT, *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )


def _load_script(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    return importlib.import_module(SCRIPT)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA path")
def test_gpu_check_without_cuda_says_so_and_exits_zero() -> None:
    proc = _run()
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "no CUDA: nothing to check"


def test_gpu_check_cpu_dry_run_passes_every_check_and_prints_the_tables() -> None:
    proc = _run("--cpu-dry-run")
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}"
    assert "FAIL" not in proc.stdout
    assert "| batch | ctx | kernel | splits |" in proc.stdout
    assert "| tokens | time (us) |" in proc.stdout
    assert "checks passed" in proc.stdout


def test_gpu_check_exits_nonzero_when_a_check_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    script = _load_script(monkeypatch)

    def failing_checks(report, plan) -> None:  # type: ignore[no-untyped-def]
        report.close("planted", torch.ones(2), torch.zeros(2), torch.float32)

    monkeypatch.setattr(script, "check_correctness", failing_checks)
    monkeypatch.setattr(sys, "argv", ["gpu_check.py", "--cpu-dry-run", "--no-bench"])
    # The dry run sets these for its process; monkeypatch restores them after this test, so
    # that every service started later in the suite runs its default path, not the kernels.
    for variable in ("TRITON_INTERPRET", "PAGEDSERVE_FORCE_TRITON"):
        monkeypatch.setenv(variable, os.environ.get(variable, "1"))
    assert script.main() == 1


def test_the_families_gpu_check_runs_end_to_end_as_a_cpu_dry_run() -> None:
    """``bench.internals.gpu_check_families`` (sliding window, soft-cap, fused MoE) before it
    meets a GPU: every step under the interpreter, every check passing."""
    r = subprocess.run(
        [sys.executable, "-m", "bench.internals.gpu_check_families", "--cpu-dry-run"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "5/5 checks passed" in r.stdout
