"""The benchmarks: scripts that measure, not tests, each run as ``python -m bench.<name>``
from the repository root (``bench/README.md`` lists them).

The ones at this level drive the executor through its facade, ``services.executor.api``,
and the served stack through its processes; ``bench.internals`` holds those that measure the
executor's internals on purpose (host work, async scheduling, tensor parallelism, kernels,
CUDA graphs, the scheduler's and the KV cache's own mechanisms). Shared helpers are in
``bench.common``.
"""
