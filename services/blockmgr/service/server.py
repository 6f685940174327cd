"""The block manager's grpc.aio server: servicer + standard health + reflection."""

from __future__ import annotations

import grpc
import structlog

from pagedserve.v1 import blockmgr_pb2 as pb
from pagedserve.v1 import blockmgr_pb2_grpc as pb_grpc
from services.blockmgr.service.config import BlockManagerServiceConfig
from services.blockmgr.service.core import BlockManagerCore
from services.blockmgr.service.servicer import BlockManagerServicer
from services.blockmgr.trace.record import TraceWriter
from services.common.auth import SERVER_OPTIONS
from services.common.gc_policy import freeze_startup_heap
from services.common.grpc_server import (
    MalformedRequestInterceptor,
    add_health_and_reflection,
    set_serving,
    stop_event,
)

log = structlog.get_logger(__name__)
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["BlockManager"].full_name


class BlockManagerServer:
    """A started server. ``port`` is the bound port (useful with ``port=0``)."""

    def __init__(self, config: BlockManagerServiceConfig, core: BlockManagerCore | None = None):
        self.config = config
        self.core = (
            core
            if core is not None
            else BlockManagerCore(
                event_buffer=config.event_buffer,
                max_pools=config.max_pools,
                max_pool_blocks=config.max_pool_blocks,
                pool_lease_s=config.pool_lease_s,
                trace=TraceWriter(config.record_trace) if config.record_trace else None,
                retention_steps=config.retention_steps,
            )
        )
        security = config.security
        self.server = grpc.aio.server(
            interceptors=[*security.interceptors(), MalformedRequestInterceptor()],
            options=[("grpc.max_receive_message_length", 64 * 1024 * 1024), *SERVER_OPTIONS],
        )
        pb_grpc.add_BlockManagerServicer_to_server(
            BlockManagerServicer(
                self.core, max_queued_event_batches=config.max_queued_event_batches
            ),
            self.server,
        )
        self.health = add_health_and_reflection(self.server, SERVICE_NAME)
        self.port = security.add_port(self.server, f"{config.host}:{config.port}")
        if self.port == 0:
            raise OSError(f"could not bind {config.host}:{config.port}")

    async def start(self) -> None:
        await self.server.start()
        await set_serving(self.health, SERVICE_NAME, True)
        security = self.config.security
        log.info(
            "blockmgr_listening",
            host=self.config.host,
            port=self.port,
            internal_token=bool(security.token),
            mtls=security.tls,
        )
        if not security.token and not security.tls:
            log.warning(
                "internal_rpcs_unauthenticated",
                hint="set --internal-token (or PAGEDSERVE_INTERNAL_TOKEN) on every service",
            )

    async def stop(self) -> None:
        await self.health.enter_graceful_shutdown()
        await self.server.stop(self.config.grace_period_s)
        if self.core.trace is not None:
            self.core.trace.close()
            log.info(
                "trace_recorded",
                path=str(self.core.trace.path),
                records=self.core.trace.num_records,
            )
        log.info("blockmgr_stopped")


async def serve(config: BlockManagerServiceConfig) -> None:
    """Run until SIGTERM/SIGINT, then shut down gracefully."""
    server = BlockManagerServer(config)
    await server.start()
    log.info("gc_frozen", objects=freeze_startup_heap())
    await stop_event().wait()
    log.info("blockmgr_shutdown_requested")
    await server.stop()
