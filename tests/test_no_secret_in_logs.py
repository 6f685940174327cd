"""No secret reaches a log: configurations are logged through a redacted view, and every line
a service writes (structlog or the standard ``logging`` of its libraries, tracebacks included)
has its secrets replaced by ``***``. The whole stack's logs are checked end to end in
``tests/test_serve.py::test_no_secret_reaches_any_service_log``."""

from __future__ import annotations

import enum
import json
import os
import subprocess
import sys
import textwrap
from dataclasses import dataclass, field

from services.common.auth import InternalSecurity
from services.common.logging import loggable
from tests.test_serve import ROOT

TOKEN = "tok-0123456789abcdef"
KEY = 'key-with-"quote"-and-\\'


class Mode(enum.Enum):
    FAST = "fast"


@dataclass(frozen=True)
class _Config:
    api_key: str | None
    unset_token: str | None = None
    mode: Mode = Mode.FAST
    sizes: tuple[int, ...] = (1, 2)
    security: InternalSecurity = field(default_factory=InternalSecurity)


def test_loggable_shows_whether_secrets_are_set_never_their_value() -> None:
    view = loggable(_Config(api_key=KEY, security=InternalSecurity(token=TOKEN)))
    assert view == {
        "api_key": "***",
        "unset_token": None,
        "mode": "fast",
        "sizes": [1, 2],
        "security": {"internal_token": True, "mtls": False},
    }
    assert TOKEN not in repr(InternalSecurity(token=TOKEN))


def test_secrets_are_scrubbed_from_structlog_and_stdlib_lines_and_tracebacks() -> None:
    script = textwrap.dedent(
        f"""
        import logging
        from services.common.logging import configure_logging

        log = configure_logging("t", "INFO", secrets=[{TOKEN!r}, {KEY!r}])
        try:
            raise RuntimeError("bad token " + {TOKEN!r})
        except RuntimeError:
            log.exception("failed", key={KEY!r})
        logging.getLogger("lib").warning("header %s", {KEY!r})
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert done.returncode == 0, done.stderr
    lines = done.stderr.splitlines()
    record = json.loads(lines[0])
    assert record["key"] == "***" and "bad token ***" in record["exception"]
    assert lines[1] == "header ***"
    for secret in (TOKEN, KEY, json.dumps(KEY)[1:-1]):
        assert secret not in done.stderr
