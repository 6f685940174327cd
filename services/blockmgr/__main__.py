"""``python -m services.blockmgr`` / ``pagedserve blockmgr``."""

from __future__ import annotations

import asyncio
import sys

from services.blockmgr.config import BlockManagerServiceConfig
from services.common.logging import configure_logging


def main(argv: list[str] | None = None) -> int:
    config = BlockManagerServiceConfig.from_args(sys.argv[1:] if argv is None else argv)
    log = configure_logging("blockmgr", config.log_level)
    log.info("blockmgr_starting", config=config.__dict__)
    from services.blockmgr.server import serve

    asyncio.run(serve(config))
    return 0


if __name__ == "__main__":
    sys.exit(main())
