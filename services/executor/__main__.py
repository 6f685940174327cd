"""``python -m services.executor`` / ``pagedserve executor --model DIR ...``."""

from __future__ import annotations

import asyncio
import sys

from services.common.logging import configure_logging
from services.executor.config import ExecutorConfig


def main(argv: list[str] | None = None) -> int:
    config = ExecutorConfig.from_args(sys.argv[1:] if argv is None else argv)
    log = configure_logging("executor", config.log_level)
    log.info("executor_starting", config=config.as_log_dict())
    from services.executor.server import serve

    return asyncio.run(serve(config))


if __name__ == "__main__":
    sys.exit(main())
