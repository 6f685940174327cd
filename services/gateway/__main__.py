"""``python -m services.gateway`` / ``pagedserve gateway --model DIR --executor HOST:PORT``.

Exits 0 after SIGTERM / SIGINT, and 2 (:data:`~services.common.logging.CONFIG_ERROR_STATUS`)
when its configuration cannot work: a bad flag (argparse), a port another process holds
(``--port``, ``--http-port``, ``--metrics-port``: checked before anything is loaded), a model
directory that is not there or holds no usable tokenizer (transformers raises ValueError), a
TLS file that cannot be read.
"""

from __future__ import annotations

import sys

from services.common.bootstrap import run_service
from services.gateway.service.config import GatewayConfig


def main(argv: list[str] | None = None) -> int:
    config = GatewayConfig.from_args(sys.argv[1:] if argv is None else argv)
    from services.gateway.service.server import serve

    ports = {
        "--port": config.port,
        "--http-port": config.http_port,
        "--metrics-port": config.metrics_port,
    }
    return run_service(
        "gateway",
        config,
        serve,
        secrets=[config.api_key, config.security.token],
        ports={flag: (config.host, port) for flag, port in ports.items()},
    )


if __name__ == "__main__":
    sys.exit(main())
