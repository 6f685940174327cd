"""``bench.internals.gpu_engine`` works before it meets a GPU: its ``--cpu-dry-run`` runs every code
path (model writing, graphed, async-scheduling and eager engine runs, profiling, HF static
batching, the report) with a tiny model on the CPU."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_gpu_engine_cpu_dry_run_prints_every_row_and_graphed_equals_eager() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "bench.internals.gpu_engine", "--cpu-dry-run"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}"
    out = proc.stdout
    for row in (
        "| ours, CUDA graphs |",
        "| ours, CUDA graphs, --async-scheduling |",
        "| ours, --enforce-eager |",
        "| HF static, batch 4 |",
    ):
        assert row in out
    assert "graphed vs eager greedy tokens: 12/12 requests identical" in out
    assert "async scheduling vs not, greedy tokens: 12/12 requests identical" in out
    assert "teacher-forced): 12 identical, 0 leave HF's argmax at a near-tie" in out
    assert "host profile of" in out  # (the warm-up run's cProfile of full-batch steps)
