"""Kernels index caches past 2^31 elements with 64-bit address arithmetic.

The work runs in ``large_index_worker.py`` in a subprocess (see its docstring): a
4 GiB fp16 cache is allocated with ``torch.empty`` but only a few blocks are touched,
so resident memory stays small, and an overflow bug crashes the child, not pytest.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

WORKER = Path(__file__).with_name("large_index_worker.py")
REPO_ROOT = Path(__file__).resolve().parents[2]


def test_all_kernels_address_blocks_beyond_int32_element_offsets() -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, str(WORKER)],
        env=env,
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, (
        f"worker exited with {proc.returncode} (negative = killed by signal, e.g. -11 "
        f"SIGSEGV from an int32 offset overflow)\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    )
    assert proc.stdout.startswith("OK"), proc.stdout
    peak_rss_mib = float(proc.stdout.split("peak_rss_mib=")[1])
    assert peak_rss_mib < 2048, f"the 4 GiB cache must stay mostly uncommitted: {proc.stdout}"
