"""``python -m services.executor`` / ``pagedserve executor --model DIR ...``."""

from __future__ import annotations

import asyncio
import os
import sys

from services.common.logging import configure_logging
from services.executor.service.config import ExecutorConfig


def main(argv: list[str] | None = None) -> int:
    """Run the executor; the process ends here (see :func:`_exit`)."""
    config = ExecutorConfig.from_args(sys.argv[1:] if argv is None else argv)
    log = configure_logging("executor", config.log_level)
    log.info("executor_starting", config=config.as_log_dict())
    from services.executor.service.server import serve

    try:
        code = asyncio.run(serve(config))
    except Exception:  # e.g. the model cannot be loaded: say why, and exit without hanging
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
