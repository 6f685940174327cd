"""Forward timers: a runner hook (``services.executor.api.RunnerHook``) that times and
counts every forward of the model."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from torch import Tensor

from services.executor.api import ForwardInfo

__all__ = ["ForwardRecord", "ForwardTimer"]


@dataclass(frozen=True)
class ForwardRecord:
    info: ForwardInfo
    seconds: float  # wall time of the forward (after ``sync``, when given)
    deltas: tuple[float, ...] = ()  # how much each of ``probe``'s counters grew during it


@dataclass
class ForwardTimer:
    """Pass as ``runner_hook``: records each forward (what it computed, its wall time) and
    counts the tokens computed. ``sync``: called before the clock stops (a device whose
    forward returns before it is done, e.g. ``torch.cuda.synchronize``). ``probe``: counters
    read before and after each forward (e.g. time spent in some op), their growth recorded.
    ``enabled`` False: forwards pass through untimed."""

    sync: Callable[[], None] | None = None
    probe: Callable[[], tuple[float, ...]] | None = None
    enabled: bool = True
    records: list[ForwardRecord] = field(default_factory=list)
    num_tokens: int = 0  # tokens computed, recomputation included

    def __call__(self, info: ForwardInfo, forward: Callable[[], Tensor]) -> Tensor:
        self.num_tokens += info.num_tokens
        if not self.enabled:
            return forward()
        probe = self.probe
        before = probe() if probe is not None else ()
        t0 = time.perf_counter()
        out = forward()
        if self.sync is not None:
            self.sync()
        seconds = time.perf_counter() - t0
        after = probe() if probe is not None else ()
        deltas = tuple(b - a for a, b in zip(before, after, strict=True))
        self.records.append(ForwardRecord(info, seconds, deltas))
        return out

    @property
    def last(self) -> ForwardRecord | None:
        return self.records[-1] if self.records else None

    def decode(self, num_seqs: int | None = None) -> list[ForwardRecord]:
        """The pure-decode forwards (of exactly ``num_seqs`` sequences, when given)."""
        return [
            r
            for r in self.records
            if r.info.is_decode and (num_seqs is None or r.info.num_seqs == num_seqs)
        ]

    def clear(self) -> None:
        self.records.clear()
        self.num_tokens = 0
