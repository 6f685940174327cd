"""Engines for the benchmarks, through the executor's facade: a model loaded once with a
fresh engine per run, and the loop that runs a set of requests to their end."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

from services.blockmgr.client import GrpcClient
from services.executor.api import (
    ExecutorConfig,
    InProcessEngine,
    LoadedModel,
    SamplingParams,
    StepOutput,
)

from .timers import ForwardTimer

__all__ = ["EngineSystem", "Run", "greedy", "run_requests"]


def greedy(max_tokens: int) -> SamplingParams:
    """Greedy, ``ignore_eos``: exactly ``max_tokens`` tokens."""
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


class EngineSystem:
    """A model loaded once (its KV cache reused) and a fresh engine per run, so that no run
    sees blocks another left in the prefix cache; the block manager in-process, or the
    service at ``blockmgr_address``. ``timer`` is every engine's runner hook: it counts the
    tokens each forward computes (recomputation after preemption included) and, when
    enabled, times the forwards."""

    def __init__(self, config: ExecutorConfig, blockmgr_address: str | None = None) -> None:
        self.config = config
        self.model = LoadedModel(config)
        self.address = blockmgr_address
        self.timer = ForwardTimer(enabled=False)

    @property
    def num_kv_blocks(self) -> int:
        return self.model.num_kv_blocks

    @contextmanager
    def engine(self) -> Iterator[InProcessEngine]:
        """A fresh engine on the loaded model, closed (every block freed, the pool given
        back) when the block ends."""
        client = GrpcClient(self.address) if self.address else None
        try:
            with InProcessEngine(
                self.config, model=self.model, blockmgr=client, runner_hook=self.timer
            ) as engine:
                yield engine
        finally:
            if client is not None:
                client.close()


@dataclass
class Run:
    """The outputs of :func:`run_requests`: each sample's tokens, keyed by (request id,
    sample index), when each request's first token came (seconds from the start) and the
    wall time from the first submission to the last output."""

    samples: dict[tuple[str, int], list[int]] = field(default_factory=dict)
    first_token_s: dict[str, float] = field(default_factory=dict)
    wall_s: float = 0.0

    @property
    def tokens(self) -> dict[str, list[int]]:
        """Sample 0's tokens of each request."""
        return {rid: t for (rid, i), t in self.samples.items() if i == 0}

    @property
    def num_output_tokens(self) -> int:
        return sum(len(t) for t in self.samples.values())


def run_requests(
    engine: InProcessEngine,
    requests: Sequence[tuple[str, Sequence[int], SamplingParams]],
    *,
    on_step: Callable[[list[StepOutput]], None] | None = None,
) -> Run:
    """Submit every ``(request id, prompt, params)`` at once, then step ``engine`` until it
    has nothing left; ``on_step`` sees each step's outputs."""
    run = Run()
    samples, firsts = run.samples, run.first_token_s
    t0 = time.perf_counter()
    for rid, prompt, params in requests:
        engine.submit(prompt, params, request_id=rid)
    while engine.has_work:
        outs = engine.step()
        now = time.perf_counter() - t0
        for o in outs:
            rid = o.request_id
            if o.token_ids and rid not in firsts:
                firsts[rid] = now
            samples.setdefault((rid, o.index), []).extend(o.token_ids)
        if on_step is not None:
            on_step(outs)
    run.wall_s = time.perf_counter() - t0
    return run
