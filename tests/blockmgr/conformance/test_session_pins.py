"""The contract's session pins (``AdmitOp.pin_ttl_s`` within ``RegisterPoolRequest.
pin_budget_blocks``): a pinned prefix outlives a flood of one-off prompts until its time and
not after; pins never keep more blocks than the budget (the oldest pin ends first); a pinned
block still counts as free and is handed out when nothing else is left; bad values are
INVALID_ARGUMENT naming the field. Skipped against an implementation that echoes no budget.

Pins count seconds on the block manager's clock: the expiry test waits until the short pin's
time has passed (a deadline, not a guess at how long the machine takes)."""

from __future__ import annotations

import math
import time

import pytest

from services.blockmgr.api.errors import ErrorCode
from services.blockmgr.api.protocol import BlockManagerClient
from services.blockmgr.api.types import Admit, Commit, Free, PoolSpec
from tests.blockmgr.conformance.ops import BS, step1
from tests.blockmgr.helpers import hashes, raises_code

NUM_BLOCKS = 17  # 16 usable
LONG_S = 600.0  # outlives any test


def _register(client: BlockManagerClient, pool_id: str, budget: int) -> int:
    info = client.register(pool_id, PoolSpec(NUM_BLOCKS, BS, pin_budget_blocks=budget))
    if info.pin_budget_blocks != budget:
        pytest.skip("this implementation serves no session pins")
    return info.epoch


def _turn(client, pool_id, epoch, seq_id, tokens, pin_ttl_s=0.0) -> int:
    """Admit, commit and free ``tokens``: the tokens its admission found cached."""
    h = hashes(tokens, BS)
    op = Admit(seq_id, len(tokens), len(tokens), h, 0, 0, pin_ttl_s)
    cached = step1(client, pool_id, epoch, op).num_cached_tokens
    client.step(pool_id, epoch, [Commit(seq_id, 0, h), Free((seq_id,))])
    return cached


def _prefix(base: int) -> list[int]:
    return list(range(base, base + 4 * BS))  # 4 full blocks


def _flood(client, pool_id, epoch, first_seq: int) -> None:
    """One-off prompts of 8 blocks, enough to turn every unpinned free block over twice."""
    for j in range(4):
        _turn(client, pool_id, epoch, first_seq + j, list(range(5000 + 100 * j, 5032 + 100 * j)))


def _cached_blocks(client, pool_id, epoch, seq_id, prefix) -> int:
    return _turn(client, pool_id, epoch, seq_id, [*prefix, 1]) // BS


def test_a_pinned_prefix_outlives_a_flood_until_its_time_and_not_after(client, pool_id) -> None:
    epoch = _register(client, pool_id, budget=8)
    kept, short, plain = _prefix(100), _prefix(200), _prefix(300)
    _turn(client, pool_id, epoch, 1, kept, pin_ttl_s=LONG_S)
    _turn(client, pool_id, epoch, 3, plain)
    pinned_at = time.monotonic()
    _turn(client, pool_id, epoch, 2, short, pin_ttl_s=0.5)
    _flood(client, pool_id, epoch, 10)
    assert _cached_blocks(client, pool_id, epoch, 20, kept) == 4
    assert _cached_blocks(client, pool_id, epoch, 21, plain) == 0  # unpinned: evicted
    while time.monotonic() < pinned_at + 0.5:  # the short pin's time passes
        time.sleep(0.05)
    _flood(client, pool_id, epoch, 30)  # (its first Step ends the short pin)
    assert _cached_blocks(client, pool_id, epoch, 40, short) == 0
    assert _cached_blocks(client, pool_id, epoch, 41, kept) == 4


def test_pins_never_keep_more_than_the_budget_the_oldest_ends_first(client, pool_id) -> None:
    epoch = _register(client, pool_id, budget=8)  # two prefixes of 4 blocks
    first, second, third = _prefix(100), _prefix(200), _prefix(300)
    for seq_id, prefix in enumerate((first, second, third), start=1):
        _turn(client, pool_id, epoch, seq_id, prefix, pin_ttl_s=LONG_S)
    _flood(client, pool_id, epoch, 10)
    assert _cached_blocks(client, pool_id, epoch, 20, first) == 0
    assert _cached_blocks(client, pool_id, epoch, 21, second) == 4
    assert _cached_blocks(client, pool_id, epoch, 22, third) == 4


def test_a_pinned_block_is_free_and_handed_out_when_nothing_else_is_left(client, pool_id) -> None:
    epoch = _register(client, pool_id, budget=8)
    _turn(client, pool_id, epoch, 1, _prefix(100), pin_ttl_s=LONG_S)
    stats = client.stats(pool_id).counters
    assert stats.num_free_blocks == NUM_BLOCKS - 1  # pins hold no block in use
    whole = list(range(7000, 7000 + 16 * BS))  # every usable block
    assert step1(client, pool_id, epoch, Admit(2, len(whole), len(whole))).num_tokens == len(whole)


def test_a_pool_without_a_budget_pins_nothing(client, pool_id) -> None:
    info = client.register(pool_id, PoolSpec(NUM_BLOCKS, BS))
    assert info.pin_budget_blocks == 0
    kept = _prefix(100)
    _turn(client, pool_id, info.epoch, 1, kept, pin_ttl_s=LONG_S)
    _flood(client, pool_id, info.epoch, 10)
    assert _cached_blocks(client, pool_id, info.epoch, 20, kept) == 0


@pytest.mark.parametrize("ttl", [-1.0, 86_401.0, math.nan, math.inf])
def test_a_pin_ttl_out_of_range_is_invalid_argument_naming_it(client, pool_id, ttl) -> None:
    epoch = _register(client, pool_id, budget=8)
    with raises_code(ErrorCode.INVALID_ARGUMENT, "ops[0].admit.pin_ttl_s"):
        client.step(pool_id, epoch, [Admit(1, 8, 8, (), 0, 0, ttl)])


@pytest.mark.parametrize("budget", [-1, NUM_BLOCKS])
def test_a_pin_budget_out_of_range_is_invalid_argument_naming_it(client, pool_id, budget) -> None:
    with raises_code(ErrorCode.INVALID_ARGUMENT, "pin_budget_blocks"):
        client.register(pool_id, PoolSpec(NUM_BLOCKS, BS, pin_budget_blocks=budget))
