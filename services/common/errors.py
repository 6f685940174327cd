"""The error every service's entry point treats as a configuration that cannot work (exit
status 2, :data:`~services.common.logging.CONFIG_ERROR_STATUS`, one ``config_error`` line)."""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration that cannot work, found by shared code (e.g. a port in use). A
    ``ValueError``, so that every entry point's tuple of configuration errors catches it.
    ``flag`` names the flag that sets what is wrong:
    :func:`~services.common.logging.config_error` logs it, so that a
    supervisor can name its own flag instead (``pagedserve serve`` says ``--blockmgr-port``
    where the block manager says ``--port``); ``details`` are logged too."""

    def __init__(self, message: str, *, flag: str | None = None, **details: object) -> None:
        super().__init__(message)
        self.flag = flag
        self.details = details
