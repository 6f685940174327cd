"""What every pagedserve gRPC server shares: standard health + reflection, health updates,
and the SIGTERM/SIGINT stop event."""

from __future__ import annotations

import asyncio
import signal

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection


def add_health_and_reflection(
    server: grpc.aio.Server, service_name: str, *, enable_reflection: bool = True
) -> health.aio.HealthServicer:
    """Register ``grpc.health.v1`` (and server reflection) on ``server``."""
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    if enable_reflection:
        reflection.enable_server_reflection(
            (service_name, health.SERVICE_NAME, reflection.SERVICE_NAME), server
        )
    return servicer


async def set_serving(
    servicer: health.aio.HealthServicer, service_name: str, serving: bool
) -> None:
    """Report the server ("") and the named service as SERVING or NOT_SERVING."""
    status = (
        health_pb2.HealthCheckResponse.SERVING
        if serving
        else health_pb2.HealthCheckResponse.NOT_SERVING
    )
    for name in ("", service_name):
        await servicer.set(name, status)


def stop_event() -> asyncio.Event:
    """An event set by SIGTERM or SIGINT (call from the running event loop)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    return stop
