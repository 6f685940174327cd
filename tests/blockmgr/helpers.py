"""Shared helpers for block-manager tests."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Iterator

import pytest

from services.blockmgr.api.errors import BlockManagerError, ErrorCode
from services.blockmgr.api.hashing import block_hashes
from services.blockmgr.api.protocol import EventStream
from services.blockmgr.api.types import KVEvent
from services.blockmgr.service.config import BlockManagerServiceConfig


@contextlib.contextmanager
def raises_code(code: ErrorCode, match: str | None = None) -> Iterator[None]:
    with pytest.raises(BlockManagerError) as info:
        yield
    assert info.value.code is code, f"expected {code}, got {info.value}"
    if match is not None:
        assert match in info.value.message, info.value.message


def hashes(tokens: list[int], block_size: int, salt: bytes = b"") -> tuple[bytes, ...]:
    return tuple(block_hashes(tokens, block_size, salt))


def collect_events(
    stream: EventStream,
    *,
    until: Callable[[list[KVEvent]], bool],
    timeout: float = 5.0,
) -> list[KVEvent]:
    """Read an event stream's batches on a thread until ``until(events so far)`` (or time out),
    then close it."""
    got: list[KVEvent] = []
    done = threading.Event()

    def reader() -> None:
        for batch in stream:
            got.extend(batch)
            if until(got):
                break
        done.set()

    t = threading.Thread(target=reader, daemon=True)
    t.start()
    done.wait(timeout)
    stream.close()
    t.join(timeout)
    return got


class ThreadedServer:
    """A real BlockManagerServer on loopback, its event loop in a background thread."""

    def __init__(self, config: BlockManagerServiceConfig | None = None) -> None:
        from services.blockmgr.service.server import BlockManagerServer

        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        config = config or BlockManagerServiceConfig(port=0, grace_period_s=0.5)

        async def start() -> BlockManagerServer:
            server = BlockManagerServer(config)
            await server.start()
            return server

        self.server = asyncio.run_coroutine_threadsafe(start(), self._loop).result(10)
        self.address = f"127.0.0.1:{self.server.port}"

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
