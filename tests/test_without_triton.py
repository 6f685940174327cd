"""A CPU host needs no triton (999 MB): the package does not require it (the ``gpu`` and
``dev`` extras do) and the whole stack serves on the CPU with it unimportable."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

from pagedserve.testing.procs import ROOT, ServeStack, run_cli
from pagedserve.tools.tiny_model import write_tiny_model

# Imported first by every Python process given this directory on PYTHONPATH: triton is then
# as if not installed (``import triton`` fails, ``importlib.util.find_spec`` finds nothing).
SITECUSTOMIZE = 'import sys\nsys.modules["triton"] = None\n'


def test_triton_is_an_extra_not_a_requirement() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = [r.split(">")[0].split("=")[0].split(";")[0].strip() for r in project["dependencies"]]
    assert "triton" not in names
    extras = project["optional-dependencies"]
    assert any(r.startswith("triton") for r in extras["gpu"])
    assert any(r.startswith("triton") for r in extras["dev"])  # the interpreter tests
    assert "['optional-dependencies']['gpu']" in (ROOT / "Dockerfile").read_text()


def test_the_stack_serves_on_the_cpu_without_triton(tmp_path, monkeypatch) -> None:
    blocker = tmp_path / "no-triton"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text(SITECUSTOMIZE)
    monkeypatch.setenv("PYTHONPATH", str(blocker))  # the CLI, the supervisor, its children
    check = subprocess.run(
        [sys.executable, "-c", "import triton"], cwd=ROOT, capture_output=True, text=True
    )
    assert check.returncode != 0 and "ModuleNotFoundError" in check.stderr
    assert run_cli("serve", "--help").returncode == 0
    stack = ServeStack(write_tiny_model(Path(tmp_path) / "model"))
    try:
        done = stack.wait_generate("generate", "Hello", "--max-tokens", "4", "--temperature", "0")
        assert done.returncode == 0, done.stderr[-2000:]
        assert done.stdout.strip()
        assert not [r for r in stack.lines if "triton" in str(r).lower()]
    finally:
        stack.stop()
