"""Admission of generation requests: queue, then refuse.

At most ``max_running`` requests run at once (sent to the executors, which run up to their
``--max-num-seqs`` and queue the rest in priority order). Requests beyond that wait here, first
come first served, for a running one to end; a request arriving when ``max_running +
max_queued`` are already open is refused at once. A waiting request that is cancelled (its
client left, its deadline passed) gives up its place; a slot freed while its new owner was
being cancelled is passed on, so no slot is ever lost.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import AsyncIterator

from services.common.limits import FieldError


class Admission:
    def __init__(self, max_running: int, max_queued: int) -> None:
        if max_running < 1 or max_queued < 0:
            raise ValueError("max_running must be >= 1 and max_queued >= 0")
        self.max_running = max_running
        self.max_queued = max_queued
        self.num_open = 0  # entered and not yet left: queued, running, or being prepared
        self.num_running = 0
        self._waiters: deque[asyncio.Future[None]] = deque()

    @property
    def num_queued(self) -> int:
        """Requests waiting for a running slot."""
        return len(self._waiters)

    def try_enter(self) -> bool:
        """Count a new request as open; False (and nothing counted) when
        ``max_running + max_queued`` already are: refuse it."""
        if self.num_open >= self.max_running + self.max_queued:
            return False
        self.num_open += 1
        return True

    def check_fits(self, n: int, field: str, what: str) -> None:
        """Raise :class:`FieldError` naming ``field`` when one request's ``n`` parts (``what``:
        prompts, inputs) are more than ever run or wait at once: some could never be admitted
        while the others hold their places."""
        capacity = self.max_running + self.max_queued
        if n > capacity:
            raise FieldError(
                field,
                f"{n} {what}, more than this gateway admits at once ({capacity}: "
                "--max-concurrent-requests + --max-queued-requests)",
            )

    def leave(self) -> None:
        """The request counted by :meth:`try_enter` is over."""
        self.num_open -= 1

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        """Hold one running slot for the body, waiting (FIFO) for one if none is free."""
        if self.num_running < self.max_running and not self._waiters:
            self.num_running += 1
        else:
            await self._wait_for_slot()
        try:
            yield
        finally:
            self._release()

    async def _wait_for_slot(self) -> None:
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await waiter  # resolved by _release: the slot is handed over, num_running unchanged
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self._release()  # handed a slot just as we were cancelled: pass it on
            else:
                with contextlib.suppress(ValueError):  # _release may have dropped it already
                    self._waiters.remove(waiter)
            raise

    def _release(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return
        self.num_running -= 1
