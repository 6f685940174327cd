"""A public trace's requests as the operations an engine sends a pool: what both replay modes
(:mod:`.sweep`: sequential; :mod:`.timed`: at the trace's times) drive the real
:class:`KVBlockManager` with.

A request is admitted with its prompt's blocks and its first output token (the leading
cached blocks hit, the rest allocated, room for the rest of its output kept free), its blocks
committed under the trace's hashes, then grown by the rest of its output; freed when it ends.
A hash id of the trace becomes whole blocks of ``block_size`` tokens, the j-th of hash id h
keyed by (h, j); the prompt's last block, which may be partial, is held and hit whole. A
request's hit is the longest run of its leading blocks already cached, in tokens, capped at
its ``input_length``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from services.blockmgr.api.types import (
    Admit,
    AdmitResult,
    Commit,
    EvictionPolicyName,
    Free,
    Grow,
    Operation,
    OpStatus,
    PoolSpec,
)
from services.blockmgr.pool.manager import KVBlockManager
from services.blockmgr.trace.public import PublicRequest, PublicTrace

__all__ = ["Point", "TracePool", "finish"]


class TracePool:
    """A fresh pool of ``capacity_tokens`` (None: room for every distinct block of ``trace``
    and its largest request) under ``policy``, in blocks of ``block_size`` tokens (default:
    the trace's), over a host tier of ``host_tokens`` (0: none; LRU)."""

    def __init__(
        self,
        trace: PublicTrace,
        capacity_tokens: int | None,
        policy: str,
        block_size: int | None = None,
        engine_rules: bool = False,
        host_tokens: int = 0,
        pin_budget: float = 0.0,
    ) -> None:
        bs = self.block_size = block_size or trace.block_tokens
        # A live engine's own rules instead of the papers': only a prompt's full blocks are
        # committed, and a hit never covers its last token (what a live replay is held to).
        self.engine_rules = engine_rules
        if trace.block_tokens % bs:
            raise ValueError(
                f"--block-size {bs} does not divide the trace's blocks of "
                f"{trace.block_tokens} tokens"
            )
        self.sub = trace.block_tokens // bs
        if capacity_tokens is None:
            distinct = len({h for r in trace.requests for h in r.hash_ids}) * self.sub
            num_blocks = distinct + max((self.blocks(r) for r in trace.requests), default=1) + 2
        else:
            num_blocks = capacity_tokens // bs + 1  # (the null block)
        spec = PoolSpec(
            num_blocks,
            bs,
            eviction_policy=EvictionPolicyName.parse(policy),
            host_blocks=host_tokens // bs,
            pin_budget_blocks=int(pin_budget * (num_blocks - 1)),
        )
        #: The trace's clock (seconds), which session pins count: the caller sets it.
        self.now = 0.0
        self.manager = KVBlockManager(spec, clock=lambda: self.now)
        self._keys: dict[int, list[bytes]] = {}

    def blocks(self, r: PublicRequest) -> int:
        """The blocks ``r`` holds at its end: its prompt's (whole) and its output's."""
        bs = self.block_size
        return -(-(len(r.hash_ids) * self.sub * bs + max(1, r.output_length)) // bs)

    def admit(self, seq: int, r: PublicRequest, pin_ttl_s: float = 0.0) -> int | None:
        """Admit request ``r`` as sequence ``seq`` (its blocks pinned ``pin_ttl_s`` once
        free): its hit tokens (capped), or None if the pool cannot hold it now (nothing
        changed)."""
        bs = self.block_size
        hashes = [k for h in r.hash_ids for k in self._hashes(h)]
        # Its whole blocks and the first output token, so that every block can hit (a hit
        # never covers the last prompt token); the rest of the output grows after.
        prompt = len(hashes) * bs + 1
        if self.engine_rules:
            hashes, prompt = hashes[: r.input_length // bs], r.input_length + 1
        later = self.blocks(r) - -(-prompt // bs)
        step = self.manager.step
        admit = Admit(seq, prompt, prompt, tuple(hashes), later, pin_ttl_s=pin_ttl_s)
        (admitted,) = step([admit])
        assert isinstance(admitted, AdmitResult)
        if admitted.status is not OpStatus.OK:
            return None
        hit = admitted.num_cached_tokens // bs
        ops: list[Operation] = [Commit(seq, hit, tuple(hashes[hit:]))]
        if r.output_length > 1:
            ops.append(Grow((seq,), (r.output_length - 1,)))
        step(ops)
        return min(hit * bs, r.input_length)

    def free(self, seq: int) -> None:
        self.manager.step([Free((seq,))])

    @property
    def idle(self) -> bool:
        """No request holds blocks."""
        return not self.manager.seqs

    def _hashes(self, h: int) -> list[bytes]:
        """Our blocks' hashes for the trace's hash id ``h``: (h, j), 32 bytes each."""
        keys = self._keys.get(h)
        if keys is None:
            base = h.to_bytes(8, "little", signed=True)
            keys = self._keys[h] = [base + j.to_bytes(24, "little") for j in range(self.sub)]
        return keys


@dataclass
class Point:
    """One replay: the JSON's names (scripts and tests read them)."""

    policy: str
    capacity_tokens: int | None  # None: unbounded
    prompt_tokens: int = 0
    hit_tokens: int = 0
    hit_ratio: float = 0.0
    max_hit_ratio: float = 0.0  # the trace's, at unbounded capacity
    num_requests: int = 0
    num_refused: int = 0  # requests larger than the pool
    num_evicted_blocks: int = 0
    seconds: float = 0.0
    host_capacity_tokens: int = 0  # the host tier's (0: none)
    host_hit_tokens: int = 0  # of the hits, onboarded from the host tier
    pin_ttl_s: float = 0.0  # session pins: requests a later turn continues, pinned so long


def finish(point: Point, trace: PublicTrace, pool: TracePool, start: float) -> Point:
    """``point`` with its ratios, the pool's evictions and the time since ``start``."""
    point.hit_ratio = point.hit_tokens / point.prompt_tokens if point.prompt_tokens else 0.0
    point.max_hit_ratio = trace.max_hit_tokens / trace.prompt_tokens if trace.prompt_tokens else 0.0
    point.num_evicted_blocks = pool.manager.pool.num_evicted
    point.host_hit_tokens = pool.manager.host_hits_tokens
    point.seconds = time.perf_counter() - start
    return point
