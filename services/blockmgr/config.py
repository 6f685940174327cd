"""Configuration of the block manager service (frozen; parsed once in the entry point)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass


@dataclass(frozen=True)
class BlockManagerServiceConfig:
    host: str = "127.0.0.1"
    port: int = 50052
    event_buffer: int = 10000  # KV events kept per pool for StreamEvents replay
    max_queued_event_batches: int = 1024  # per StreamEvents consumer before it is cut off
    grace_period_s: float = 5.0  # in-flight RPCs get this long on SIGTERM
    log_level: str = "INFO"

    @classmethod
    def parser(cls) -> argparse.ArgumentParser:
        p = argparse.ArgumentParser(
            prog="pagedserve blockmgr", description="Run the KV block manager gRPC service."
        )
        p.add_argument("--host", default=cls.host, help="address to bind (default %(default)s)")
        p.add_argument(
            "--port",
            type=int,
            default=cls.port,
            help="port to bind; 0 picks a free one (default %(default)s)",
        )
        p.add_argument(
            "--event-buffer",
            type=int,
            default=cls.event_buffer,
            help="KV events kept per pool for replay (default %(default)s)",
        )
        p.add_argument(
            "--max-queued-event-batches",
            type=int,
            default=cls.max_queued_event_batches,
            help="event batches queued per slow consumer before it is cut off",
        )
        p.add_argument(
            "--grace-period-s",
            type=float,
            default=cls.grace_period_s,
            help="seconds in-flight RPCs get on shutdown (default %(default)s)",
        )
        p.add_argument("--log-level", default=cls.log_level)
        return p

    @classmethod
    def from_args(cls, argv: list[str]) -> BlockManagerServiceConfig:
        a = cls.parser().parse_args(argv)
        if not 0 <= a.port <= 65535:
            cls.parser().error("--port must be in [0, 65535]")
        if a.event_buffer < 1 or a.max_queued_event_batches < 1:
            cls.parser().error("--event-buffer and --max-queued-event-batches must be >= 1")
        return cls(
            host=a.host,
            port=a.port,
            event_buffer=a.event_buffer,
            max_queued_event_batches=a.max_queued_event_batches,
            grace_period_s=a.grace_period_s,
            log_level=a.log_level,
        )
