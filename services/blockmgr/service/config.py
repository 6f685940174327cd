"""Configuration of the block manager service (frozen; parsed once in the entry point)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from services.blockmgr.eviction.retention import DEFAULT_RETENTION_STEPS
from services.common.auth import InternalSecurity


@dataclass(frozen=True)
class BlockManagerServiceConfig:
    host: str = "127.0.0.1"
    port: int = 50052
    event_buffer: int = 10000  # KV events kept per pool for StreamEvents replay
    max_queued_event_batches: int = 1024  # per StreamEvents consumer before it is cut off
    grace_period_s: float = 5.0  # in-flight RPCs get this long on SIGTERM
    max_pools: int = 64
    max_pool_blocks: int = 2**22
    pool_lease_s: float = 30.0  # a pool whose owner made no call this long is reclaimed
    security: InternalSecurity = field(default_factory=InternalSecurity)
    log_level: str = "INFO"
    record_trace: str | None = None  # append every pool-changing call here (offline replay)
    retention_steps: int = DEFAULT_RETENTION_STEPS  # Steps a freed block keeps its priority

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
        p.add_argument(
            "--max-pools",
            type=int,
            default=cls.max_pools,
            help="pools (executors) served at once (default %(default)s)",
        )
        p.add_argument(
            "--max-pool-blocks",
            type=int,
            default=cls.max_pool_blocks,
            help="largest num_blocks a pool may register (default %(default)s)",
        )
        p.add_argument(
            "--pool-lease-s",
            type=float,
            default=cls.pool_lease_s,
            help="reclaim a pool whose owner made no call for this long; 0: never "
            "(default %(default)s)",
        )
        InternalSecurity.add_args(p)
        p.add_argument("--log-level", default=cls.log_level)
        p.add_argument(
            "--retention-steps",
            type=int,
            default=cls.retention_steps,
            help="Steps of its pool a freed block keeps the retention priority its requests gave "
            "it, before it is evicted like any other (default %(default)s)",
        )
        p.add_argument(
            "--record-trace",
            default=None,
            metavar="FILE",
            help="append every Register, Step, Restore and Unregister to FILE (JSON lines) for "
            "`pagedserve blockmgr replay`",
        )
        return p

    @classmethod
    def from_args(cls, argv: list[str]) -> BlockManagerServiceConfig:
        p = cls.parser()
        ns = vars(p.parse_args(argv))
        security = InternalSecurity.from_namespace(ns)
        try:
            config = cls(**ns, security=security)
            config.validate()
        except ValueError as exc:
            p.error(str(exc))
        return config

    def validate(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError("--port must be in [0, 65535]")
        if self.event_buffer < 1 or self.max_queued_event_batches < 1:
            raise ValueError("--event-buffer and --max-queued-event-batches must be >= 1")
        if self.max_pools < 1 or self.max_pool_blocks < 2:
            raise ValueError("--max-pools must be >= 1 and --max-pool-blocks >= 2")
        if self.pool_lease_s < 0:
            raise ValueError("--pool-lease-s must be >= 0")
        if self.retention_steps < 0:
            raise ValueError("--retention-steps must be >= 0")
        self.security.validate()
