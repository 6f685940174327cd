"""Choosing the executor for a request.

Policies (``--routing``):

- ``least-loaded``: the executor with the fewest load tokens;
- ``round-robin``: each ready executor in turn;
- ``prefix-aware``: the executor with the highest score

  ``score = cached_prefix_tokens - load_weight * load_tokens``

  where ``cached_prefix_tokens`` is how much of the prompt's prefix the executor's pool is
  expected to hold (the :class:`PrefixIndex`, fed by the block manager's KV events and by this
  gateway's own routing) and ``load_tokens`` is the executor's running + waiting tokens (see
  :class:`Candidate`). ``load_weight`` (``--routing-load-weight``) trades cache hits for
  balance: 0 follows the cache whatever the queue; large values make it least-loaded. A cached
  token saves one token of prefill; a load token is a token of KV already queued or running
  there, which this request will wait behind or share steps with.

  With no live index (no block manager address, or its event stream down) it falls back to
  least-loaded.

Ties (typically: a prefix no executor holds, arriving while several are idle) go to the
executor with the fewest load tokens, then to the one that was sent the fewest prompt tokens
recently (decayed with a half-life of ``RECENT_HALF_LIFE_S``: this spreads new prefixes, and
with them the traffic that follows them, evenly), then in rotation. Pure: no gRPC.
"""

from __future__ import annotations

import enum
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from services.blockmgr.api.hashing import block_hashes
from services.gateway.fleet.prefix_index import PrefixIndex

DEFAULT_LOAD_WEIGHT = 0.3
RECENT_HALF_LIFE_S = 30.0


class RoutingPolicy(enum.StrEnum):
    PREFIX_AWARE = "prefix-aware"
    LEAST_LOADED = "least-loaded"
    ROUND_ROBIN = "round-robin"


@dataclass(frozen=True, slots=True)
class Candidate:
    """A ready executor as the router sees it.

    ``load_tokens``: the larger of the executor's last reported running + waiting tokens (every
    gateway's requests, but a step old) and the tokens of this gateway's own requests there
    (prompt + streamed so far: fresh, but only its own)."""

    key: str
    pool_id: str
    block_size: int
    prefix_caching: bool
    load_tokens: int
    salt: bytes | None = None  # what it salts the prompt's first block with (None: the request's)


@dataclass(frozen=True, slots=True)
class Decision:
    index: int  # into the candidates
    policy: RoutingPolicy  # the policy that decided (after any fallback)
    predicted_cached_tokens: int
    scores: tuple[float, ...] = ()  # per candidate, prefix-aware only


class Router:
    def __init__(
        self,
        policy: RoutingPolicy,
        index: PrefixIndex | None = None,
        *,
        load_weight: float = DEFAULT_LOAD_WEIGHT,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if policy == RoutingPolicy.PREFIX_AWARE and index is None:
            raise ValueError("prefix-aware routing needs a prefix index")
        if load_weight < 0:
            raise ValueError("load_weight must be >= 0")
        self.policy = policy
        self.index = index
        self.load_weight = load_weight
        self._turn = 0
        self._clock = clock
        self._recent: dict[str, tuple[float, float]] = {}  # key -> (decayed tokens, as of)

    def choose(
        self, candidates: Sequence[Candidate], prompt_ids: Sequence[int], cache_salt: bytes = b""
    ) -> Decision:
        """Pick one of ``candidates`` (non-empty) for the prompt, and remember the choice in
        the index (the prompt's blocks will be cached there)."""
        if not candidates:
            raise ValueError("no candidates")
        self._turn += 1
        index = self.index
        if self.policy == RoutingPolicy.ROUND_ROBIN:
            decision = Decision(self._turn % len(candidates), RoutingPolicy.ROUND_ROBIN, 0)
        elif (
            self.policy == RoutingPolicy.PREFIX_AWARE
            and index is not None
            and any(index.is_synced(c.pool_id) for c in candidates)
        ):
            decision = self._prefix_aware(index, candidates, prompt_ids, cache_salt)
        else:
            scores = tuple(0.0 for _ in candidates)
            decision = Decision(self._best(candidates, scores), RoutingPolicy.LEAST_LOADED, 0)
        self._sent(candidates[decision.index].key, len(prompt_ids))
        return decision

    def _best(self, candidates: Sequence[Candidate], scores: Sequence[float]) -> int:
        """Highest score; ties: fewest load tokens, fewest recent tokens, rotation."""
        n = len(candidates)
        now = self._clock()
        recent = [self._recent_tokens(c.key, now) for c in candidates]
        order = [(self._turn + i) % n for i in range(n)]
        return max(order, key=lambda i: (scores[i], -candidates[i].load_tokens, -recent[i]))

    def _recent_tokens(self, key: str, now: float) -> float:
        tokens, as_of = self._recent.get(key, (0.0, now))
        return tokens * math.exp2(-(now - as_of) / RECENT_HALF_LIFE_S)

    def _sent(self, key: str, num_tokens: int) -> None:
        now = self._clock()
        self._recent[key] = (self._recent_tokens(key, now) + num_tokens, now)
        if len(self._recent) > 4096:  # executors come and go (DNS discovery): forget the idle
            self._recent = {k: v for k, v in self._recent.items() if now - v[1] < 600}

    def _prefix_aware(
        self,
        index: PrefixIndex,
        candidates: Sequence[Candidate],
        prompt_ids: Sequence[int],
        cache_salt: bytes,
    ) -> Decision:
        hashes_by_key: dict[tuple[int, bytes], list[bytes]] = {}
        cached: list[int] = []
        for c in candidates:
            if not c.prefix_caching:
                cached.append(0)
                continue
            key = (c.block_size, cache_salt if c.salt is None else c.salt)
            hashes = hashes_by_key.get(key)
            if hashes is None:
                hashes = hashes_by_key[key] = block_hashes(prompt_ids, *key)
            # The last prompt token is always computed: a block holding it is never reused.
            reusable = hashes[: (len(prompt_ids) - 1) // c.block_size]
            cached.append(index.match(c.pool_id, reusable) * c.block_size)
        scores = tuple(
            cached[i] - self.load_weight * c.load_tokens for i, c in enumerate(candidates)
        )
        best = self._best(candidates, scores)
        chosen = candidates[best]
        if chosen.prefix_caching:
            salt = cache_salt if chosen.salt is None else chosen.salt
            index.note_routed(chosen.pool_id, hashes_by_key[(chosen.block_size, salt)])
        return Decision(best, RoutingPolicy.PREFIX_AWARE, cached[best], scores)
