"""Timed replay of a public trace (``--timed``): requests arrive at their timestamps (divided
by ``time_scale``) and hold their blocks for a service time from a stated model, as an
engine's running requests do: blocks in use cannot be evicted, and an admission that does not
fit waits, first come first served, as an engine's would.

The service model (:class:`ServiceModel`): a request runs ``uncached prompt tokens /
prefill_tokens_per_s + output_length / decode_tokens_per_s`` seconds, and at most
``max_concurrency`` run at once. Its hit is counted when it is admitted (what is cached then).
A request larger than the whole pool, when nothing else holds blocks, is refused (counted).
"""

from __future__ import annotations

import heapq
import time
from collections import deque
from dataclasses import dataclass

from services.blockmgr.trace.public import PublicRequest, PublicTrace
from services.blockmgr.trace.trace_pool import Point, TracePool, finish

__all__ = ["ServiceModel", "TimedPoint", "replay_timed"]


@dataclass(frozen=True)
class ServiceModel:
    """How long a request holds its blocks, and how many run at once."""

    prefill_tokens_per_s: float = 10_000.0
    decode_tokens_per_s: float = 30.0  # per running request
    max_concurrency: int = 64
    time_scale: float = 1.0  # arrivals at timestamp / time_scale

    def __post_init__(self) -> None:
        for name in ("prefill_tokens_per_s", "decode_tokens_per_s", "time_scale"):
            if not getattr(self, name) > 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0")
        if self.max_concurrency < 1:
            raise ValueError("--max-concurrency must be >= 1")

    def service_s(self, r: PublicRequest, hit_tokens: int) -> float:
        prefill = (r.input_length - hit_tokens) / self.prefill_tokens_per_s
        return prefill + r.output_length / self.decode_tokens_per_s


@dataclass
class TimedPoint(Point):
    """A timed replay: a point, and how long requests waited for admission."""

    mean_wait_s: float = 0.0
    max_waiting: int = 0  # the longest the admission queue was


def replay_timed(
    trace: PublicTrace,
    capacity_tokens: int | None,
    policy: str,
    block_size: int | None = None,
    model: ServiceModel | None = None,
    host_tokens: int = 0,
) -> TimedPoint:
    """Replay ``trace`` at its times under ``model`` (see the module docstring), over a host
    tier of ``host_tokens`` (0: none)."""
    model = model or ServiceModel()
    start = time.perf_counter()
    pool = TracePool(trace, capacity_tokens, policy, block_size, host_tokens=host_tokens)
    point = TimedPoint(policy, capacity_tokens, num_requests=len(trace.requests))
    point.host_capacity_tokens = host_tokens
    running: list[tuple[float, int]] = []  # (end time, seq): a heap
    waiting: deque[tuple[int, float]] = deque()  # (seq, arrival time)
    requests = trace.requests
    waited = now = 0.0

    def admit_waiting(now: float) -> None:
        nonlocal waited
        while waiting and len(running) < model.max_concurrency:
            seq, arrival = waiting[0]
            r = requests[seq]
            hit = pool.admit(seq, r)
            if hit is None:
                if pool.idle:  # it can never fit
                    waiting.popleft()
                    point.num_refused += 1
                    continue
                return  # first come, first served: it waits for blocks to be freed
            waiting.popleft()
            point.hit_tokens += hit
            waited += now - arrival
            heapq.heappush(running, (now + model.service_s(r, hit), seq))

    def run_until(t: float) -> None:
        nonlocal now
        while running and running[0][0] <= t:
            now, seq = heapq.heappop(running)
            pool.free(seq)
            admit_waiting(now)
        now = max(now, t)

    for seq, r in enumerate(requests):
        arrival = r.timestamp_s / model.time_scale
        run_until(arrival)
        point.prompt_tokens += r.input_length
        waiting.append((seq, arrival))
        point.max_waiting = max(point.max_waiting, len(waiting))
        admit_waiting(arrival)
    while running or waiting:
        if not running:  # (nothing holds blocks: the head is refused, the next admitted)
            admit_waiting(now)
            continue
        run_until(running[0][0])
    admitted = point.num_requests - point.num_refused
    point.mean_wait_s = waited / admitted if admitted else 0.0
    finish(point, trace, pool, start)
    return point
