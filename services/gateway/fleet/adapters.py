"""The LoRA adapters across the executors: which ready executor serves which adapter (each
connection's ``adapters``, read when it connects), and loading and unloading on all of them.
(Routing reads the connections' adapters itself: ``ExecutorPool.pick``.)"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

import grpc

from pagedserve.v1 import executor_pb2
from services.gateway.fleet.executor_client import ExecutorConnection, ExecutorPool

__all__ = ["AdapterCallError", "AdapterFleet", "AdapterSummary"]

T = TypeVar("T")


class AdapterCallError(Exception):
    """An executor refused an adapter call: ``code`` is its gRPC status."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


@dataclass(frozen=True)
class AdapterSummary:
    """One adapter name across the executors."""

    name: str
    path: str
    rank: int
    digest: str  # hex; of the first executor listed (each read its own files)
    num_executors: int
    num_running: int

    @classmethod
    def of(cls, name: str, infos: list[executor_pb2.AdapterInfo]) -> AdapterSummary:
        """``name`` as the executors (``infos``, one each, non-empty) describe it."""
        first = infos[0]
        running = sum(i.num_running for i in infos)
        return cls(name, first.path, first.rank, first.digest.hex(), len(infos), running)


class AdapterFleet:
    def __init__(self, pool: ExecutorPool, timeout_s: float = 60.0) -> None:
        self.pool = pool
        self.timeout_s = timeout_s

    def serving(self, name: str) -> list[ExecutorConnection]:
        return [c for c in self.pool.ready if name in c.adapters]

    async def load(self, name: str, path: str, replace: bool) -> list[executor_pb2.AdapterInfo]:
        """Load on every ready executor, together; the first refusal is raised once all have
        answered (those that loaded it keep it)."""
        conns = self.pool.ready
        if not conns:
            raise AdapterCallError(grpc.StatusCode.UNAVAILABLE, "no executor is serving")
        request = executor_pb2.LoadAdapterRequest(name=name, path=path, replace=replace)

        async def one(conn: ExecutorConnection) -> executor_pb2.AdapterInfo:
            info = await conn.adapter_stub.LoadAdapter(
                request, timeout=self.timeout_s, metadata=conn.metadata
            )
            conn.adapters[name] = info
            return info

        return await _all(conns, one)

    async def unload(self, name: str) -> None:
        """Unload from every ready executor serving it; NOT_FOUND if none does."""
        conns = self.serving(name)
        if not conns:
            raise AdapterCallError(
                grpc.StatusCode.NOT_FOUND, f"lora_name: no executor serves {name!r}"
            )
        request = executor_pb2.UnloadAdapterRequest(name=name)

        async def one(conn: ExecutorConnection) -> None:
            await conn.adapter_stub.UnloadAdapter(
                request, timeout=self.timeout_s, metadata=conn.metadata
            )
            conn.adapters.pop(name, None)

        await _all(conns, one)

    async def listing(self) -> list[AdapterSummary]:
        """Every adapter a ready executor serves, read afresh from each."""
        conns = self.pool.ready

        async def one(conn: ExecutorConnection) -> dict[str, executor_pb2.AdapterInfo]:
            conn.adapters = await conn.list_adapters()
            return conn.adapters

        by_name: dict[str, list[executor_pb2.AdapterInfo]] = {}
        for adapters in await _all(conns, one):
            for name, info in adapters.items():
                by_name.setdefault(name, []).append(info)
        return [AdapterSummary.of(name, infos) for name, infos in sorted(by_name.items())]


async def _all(
    conns: list[ExecutorConnection], call: Callable[[ExecutorConnection], Awaitable[T]]
) -> list[T]:
    """``call`` on every connection together; the first failure raised once all answered."""
    results = await asyncio.gather(*(call(c) for c in conns), return_exceptions=True)
    out: list[T] = []
    for conn, result in zip(conns, results, strict=True):
        if isinstance(result, grpc.aio.AioRpcError):
            raise AdapterCallError(result.code(), result.details() or f"executor {conn.address}")
        if isinstance(result, BaseException):
            raise result
        out.append(result)
    return out
