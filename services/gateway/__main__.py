"""``python -m services.gateway`` / ``pagedserve gateway --model DIR --executor HOST:PORT``.

Exits 0 after SIGTERM / SIGINT, and 2 (:data:`~services.common.logging.CONFIG_ERROR_STATUS`)
when its configuration cannot work: a bad flag (argparse), a port another process holds
(``--port``, ``--http-port``, ``--metrics-port``: checked before anything is loaded), a model
directory that is not there or holds no usable tokenizer, a TLS file that cannot be read.
"""

from __future__ import annotations

import asyncio
import sys

from services.common.logging import (
    FILE_CONFIG_ERRORS,
    config_error,
    configure_logging,
    loggable,
)
from services.common.ports import check_ports
from services.gateway.service.config import GatewayConfig

# What the start-up raises on a configuration that cannot work (transformers raises
# ValueError for a directory without a usable tokenizer).
CONFIG_ERRORS: tuple[type[Exception], ...] = (*FILE_CONFIG_ERRORS, ValueError)


def main(argv: list[str] | None = None) -> int:
    config = GatewayConfig.from_args(sys.argv[1:] if argv is None else argv)
    secrets = [config.api_key, config.security.token]
    log = configure_logging("gateway", config.log_level, secrets=secrets)
    log.info("gateway_starting", config=loggable(config))
    try:
        ports = {
            "--port": config.port,
            "--http-port": config.http_port,
            "--metrics-port": config.metrics_port,
        }
        check_ports({flag: (config.host, port) for flag, port in ports.items()})
        from services.gateway.service.server import serve

        return asyncio.run(serve(config))
    except CONFIG_ERRORS as exc:
        return config_error(log, exc)


if __name__ == "__main__":
    sys.exit(main())
