"""``python -m services.gateway`` / ``pagedserve gateway --model DIR --executor HOST:PORT``."""

from __future__ import annotations

import asyncio
import sys

from services.common.logging import configure_logging
from services.gateway.config import GatewayConfig


def main(argv: list[str] | None = None) -> int:
    config = GatewayConfig.from_args(sys.argv[1:] if argv is None else argv)
    log = configure_logging("gateway", config.log_level)
    log.info("gateway_starting", config=config.as_log_dict())
    from services.gateway.server import serve

    return asyncio.run(serve(config))


if __name__ == "__main__":
    sys.exit(main())
