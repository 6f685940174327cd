"""The block manager's grpc.aio server: servicer + standard health + reflection."""

from __future__ import annotations

import structlog

from pagedserve.v1 import blockmgr_pb2 as pb
from pagedserve.v1 import blockmgr_pb2_grpc as pb_grpc
from services.blockmgr.service.config import BlockManagerServiceConfig
from services.blockmgr.service.core import BlockManagerCore
from services.blockmgr.service.servicer import BlockManagerServicer
from services.blockmgr.trace.record import TraceWriter
from services.common.bootstrap import InternalServer
from services.common.gc_policy import freeze_startup_heap
from services.common.grpc_server import set_serving, stop_event

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
        self.grpc = InternalServer(config.security, SERVICE_NAME, config.host, config.port)
        self.server, self.health = self.grpc.server, self.grpc.health
        pb_grpc.add_BlockManagerServicer_to_server(
            BlockManagerServicer(
                self.core, max_queued_event_batches=config.max_queued_event_batches
            ),
            self.server,
        )
        self.port = self.grpc.bind()

    async def start(self) -> None:
        await self.grpc.start(log, "blockmgr_listening")
        await set_serving(self.health, SERVICE_NAME, True)

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
