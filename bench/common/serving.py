"""Driving a served stack from a bench: every request at once through one of ``pagedserve
bench serve``'s clients (gRPC or OpenAI HTTP), summarized as that command summarizes."""

from __future__ import annotations

import asyncio
import time
from typing import Protocol

from services.bench.backends import RequestOutput
from services.bench.datasets import BenchRequest
from services.bench.results import summarize

__all__ = ["Backend", "drive"]


class Backend(Protocol):
    async def send(self, req: BenchRequest, ignore_eos: bool) -> RequestOutput: ...
    async def close(self) -> None: ...


async def drive(backend: Backend, requests: list[BenchRequest]) -> dict[str, object]:
    """Send ``requests`` at once (``ignore_eos``) and close ``backend``: the summary of the
    run; raises ``RuntimeError`` with the first failed request's error. Make ``backend`` in
    the running loop: a gRPC client made before ``asyncio.run`` is bound to another loop."""
    try:
        t0 = time.perf_counter()
        outputs = await asyncio.gather(*(backend.send(r, True) for r in requests))
        duration = time.perf_counter() - t0
    finally:
        await backend.close()
    if any(not o.success for o in outputs):
        raise RuntimeError(next(o.error for o in outputs if not o.success))
    return summarize(outputs, duration, t0)
