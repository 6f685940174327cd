"""Suite-wide setup.

Without CUDA, Triton kernels run under the interpreter: TRITON_INTERPRET must be set before
anything imports triton, so it is set here, first.

Every batch builder of the suite (and of the executor processes it starts) checks its mirrored
block tables against the tables it is given, so a table changed other than by appending fails
the test that did it (see services/executor/model/host_block_tables.py).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator

os.environ.setdefault("PAGEDSERVE_VERIFY_BLOCK_TABLES", "1")
# Under pytest-xdist (make test, make test-fast) each worker runs one intra-op thread: an
# in-process runner sets the threads it is given, else the host's cores unless
# OMP_NUM_THREADS is set (RunnerConfig.torch_threads), and two workers running 2 threads each
# on 2 cores made one test 40x slower (0.8 s -> 32 s). In a serial run, runners take the cores.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")

if not shutil.which("nvidia-smi"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch
from hypothesis import settings

from tests.markers import MARKERS, mark_by_behaviour

# Hypothesis example counts come from a profile (``--hypothesis-profile``, or the
# HYPOTHESIS_PROFILE variable): ``ci`` (the default) runs each test's own count, ``fast`` a
# quarter of it (``make test-fast``), ``soak`` ten times it. Tests give their counts through
# ``tests.hypothesis_budget.examples(n)``, which scales by the profile loaded. No profile has
# a per-example deadline: on a busy machine an example's wall time says nothing about it.
settings.register_profile("ci", max_examples=100, deadline=None)
settings.register_profile("fast", max_examples=25, deadline=None)
settings.register_profile("soak", max_examples=1000, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

torch.set_num_threads(1)


# Set once for the whole process by the libraries themselves: pytest's current test, and
# torch inductor's cache directory (set on its first use, whichever test that is).
_PROCESS_WIDE = frozenset({"PYTEST_CURRENT_TEST", "TORCHINDUCTOR_CACHE_DIR"})


@pytest.fixture(autouse=True)
def _no_environment_leak() -> Iterator[None]:
    """A test that changes ``os.environ`` without restoring it fails: the processes later tests
    start inherit the environment (a leaked ``PAGEDSERVE_FORCE_TRITON`` once sent every later
    stack through the Triton interpreter). Set variables with ``monkeypatch.setenv``."""
    before = dict(os.environ)
    yield
    after = dict(os.environ)
    changed = sorted(
        k
        for k in before.keys() | after.keys()
        if before.get(k) != after.get(k) and k not in _PROCESS_WIDE
    )
    if changed:
        os.environ.clear()
        os.environ.update(before)
        pytest.fail(f"the test left environment variables changed: {changed}")


def pytest_configure(config: pytest.Config) -> None:
    for name, description in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {description}")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    mark_by_behaviour(items)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--blockmgr-address",
        default=None,
        help="also run the block-manager conformance suite against the server at host:port",
    )
