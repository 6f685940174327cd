"""``python -m services.executor`` / ``pagedserve executor --model DIR ...``.

Exits 0 after SIGTERM / SIGINT, 1 when the engine dies or the start-up fails otherwise, and 2
(:data:`~services.common.logging.CONFIG_ERROR_STATUS`) when its configuration cannot work: a
bad flag (argparse), a model that cannot be loaded or is not supported as configured
(:class:`~services.executor.model.errors.ModelLoadError`, e.g. attention heads that
``--tensor-parallel-size`` does not divide), a KV cache too small for ``--max-model-len``
(``ValueError``), a file that cannot be read.
"""

from __future__ import annotations

import asyncio
import os
import sys

from services.common.logging import (
    FILE_CONFIG_ERRORS,
    config_error,
    configure_logging,
    loggable,
)
from services.executor.model.errors import ModelLoadError
from services.executor.service.config import ExecutorConfig

# What the start-up (model load, KV-cache sizing) raises on a configuration that cannot work.
CONFIG_ERRORS: tuple[type[Exception], ...] = (ModelLoadError, ValueError, *FILE_CONFIG_ERRORS)


def main(argv: list[str] | None = None) -> int:
    """Run the executor; the process ends here (see :func:`_exit`)."""
    config = ExecutorConfig.from_args(sys.argv[1:] if argv is None else argv)
    log = configure_logging("executor", config.log_level, secrets=[config.security.token])
    log.info("executor_starting", config=loggable(config))
    from services.executor.service.server import serve

    try:
        code = asyncio.run(serve(config))
    except CONFIG_ERRORS as exc:
        code = config_error(log, exc)
    except Exception:  # e.g. the engine cannot start: say why, and exit without hanging
        log.exception("executor_failed")
        code = 1
    _exit(code)
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
