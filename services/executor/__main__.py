"""``python -m services.executor`` / ``pagedserve executor --model DIR ...``.

Exits 0 after SIGTERM / SIGINT, 1 when the engine dies or the start-up fails otherwise, and 2
(:data:`~services.common.logging.CONFIG_ERROR_STATUS`) when its configuration cannot work: a
bad flag (argparse), a model that cannot be loaded or is not supported as configured
(:class:`~services.executor.model.errors.ModelLoadError`, e.g. attention heads that
``--tensor-parallel-size`` does not divide), a KV cache too small for ``--max-model-len``
(``ValueError``), a file that cannot be read.
"""

from __future__ import annotations

import os
import sys

from services.common.bootstrap import run_service
from services.executor.model.errors import ModelLoadError
from services.executor.service.config import ExecutorConfig


def main(argv: list[str] | None = None) -> int:
    """Run the executor; the process ends here (see :func:`_exit`)."""
    config = ExecutorConfig.from_args(sys.argv[1:] if argv is None else argv)
    from services.executor.service.server import serve

    # A model that cannot be loaded as configured is a configuration error; an engine that
    # cannot start otherwise is said, and the process exits without hanging.
    _exit(
        run_service(
            "executor",
            config,
            serve,
            secrets=[config.security.token],
            config_errors=(ModelLoadError,),
            crash_event="executor_failed",
        )
    )
    return 1  # unreachable


def _exit(code: int) -> None:
    """Leave without interpreter finalization once the server stopped cleanly: torch pulls in
    Triton, whose nanobind extension prints spurious reference-leak reports at finalization,
    interleaved with our JSON log lines."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
