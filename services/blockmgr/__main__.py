"""``python -m services.blockmgr`` / ``pagedserve blockmgr``; ``pagedserve blockmgr replay FILE``
replays a recorded trace offline (:mod:`services.blockmgr.trace.replay`).

Exits 0 after SIGTERM / SIGINT, and 2 (:data:`~services.common.logging.CONFIG_ERROR_STATUS`)
when its configuration cannot work: a bad flag (argparse), an mTLS file that cannot be read.
"""

from __future__ import annotations

import sys

from services.blockmgr.service.config import BlockManagerServiceConfig
from services.common.bootstrap import run_service


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["replay"]:  # `pagedserve blockmgr replay FILE ...`: offline, no service
        from services.blockmgr.trace.replay import main as replay_main

        return replay_main(args[1:])
    config = BlockManagerServiceConfig.from_args(args)
    from services.blockmgr.service.server import serve

    return run_service("blockmgr", config, serve, secrets=[config.security.token])


if __name__ == "__main__":
    sys.exit(main())
