"""The contract's KV-cache groups: one FULL or SLIDING group per pool, written once against
:class:`BlockManagerClient`.

Skipped against an implementation whose Info says ``max_kv_cache_groups == 0`` (it predates
groups). Asserts contract behaviour only: which entries are null, counts, hits, the eviction
order of blocks released out of the window (the order is part of the contract), never our
particular block ids.
"""

from __future__ import annotations

import pytest

from services.blockmgr.api.errors import ErrorCode
from services.blockmgr.api.protocol import BlockManagerClient
from services.blockmgr.api.types import (
    AttentionKindName,
    Commit,
    CommitResult,
    Fork,
    ForkResult,
    Free,
    FreeResult,
    KVCacheGroup,
    KVEventKind,
    OpStatus,
    PoolSpec,
    RestoredSequence,
)
from tests.blockmgr.conformance.ops import BS
from tests.blockmgr.conformance.ops import admit as _admit
from tests.blockmgr.conformance.ops import grow as _grow
from tests.blockmgr.conformance.ops import in_use as _in_use
from tests.blockmgr.conformance.ops import step1 as _step1
from tests.blockmgr.helpers import collect_events, hashes, raises_code

FULL = KVCacheGroup(AttentionKindName.FULL, 0, ())


def _window(w: int, layers: tuple[int, ...] = ()) -> KVCacheGroup:
    return KVCacheGroup(AttentionKindName.SLIDING, w, layers)


@pytest.fixture
def max_groups(client: BlockManagerClient) -> int:
    n = client.info().max_kv_cache_groups
    if n == 0:
        pytest.skip("this implementation predates KV-cache groups (max_kv_cache_groups == 0)")
    return n


def _register(client, pool_id, window: int, num_blocks: int = 16, **kw) -> int:
    return client.register(
        pool_id, PoolSpec(num_blocks, BS, groups=tuple([_window(window)]), **kw)
    ).epoch


def _removed(events) -> int:
    return sum(len(e.block_hashes) for e in events if e.kind is KVEventKind.REMOVED)


# ---- registration -------------------------------------------------------------------------------


def test_a_pool_registered_without_groups_has_one_full_group(client, pool_id, max_groups):
    assert max_groups >= 1
    info = client.register(pool_id, PoolSpec(16, BS))
    assert info.groups == (FULL,)
    assert client.info(pool_id).pools[0].groups == (FULL,)


def test_a_sliding_group_is_echoed_by_register_info_and_stats(client, pool_id, max_groups):
    group = _window(4096, (0, 2, 4, 6))
    info = client.register(pool_id, PoolSpec(16, BS, groups=tuple([group])))
    assert info.groups == (group,)
    assert client.info(pool_id).pools[0].groups == (group,)
    assert client.stats(pool_id).pool.groups == (group,)


def test_more_groups_than_the_implementation_serves_are_refused(client, pool_id, max_groups):
    with raises_code(ErrorCode.INVALID_ARGUMENT, "groups"):
        client.register(pool_id, PoolSpec(16, BS, groups=tuple([FULL] * (max_groups + 1))))
    with raises_code(ErrorCode.NOT_FOUND):
        client.info(pool_id)


@pytest.mark.parametrize(
    "group",
    [_window(0), _window(-8), KVCacheGroup(AttentionKindName.FULL, 8, ())],
    ids=["sliding-0", "sliding-negative", "full-with-window"],
)
def test_bad_windows_are_invalid_argument(client, pool_id, max_groups, group):
    with raises_code(ErrorCode.INVALID_ARGUMENT, "groups[0].sliding_window"):
        client.register(pool_id, PoolSpec(16, BS, groups=tuple([group])))


def test_reregistering_with_other_groups_is_a_new_epoch(client, pool_id, max_groups):
    first = _register(client, pool_id, window=8)
    _admit(client, pool_id, first, 1, list(range(12)))
    again = client.register(pool_id, PoolSpec(16, BS))
    assert again.epoch > first and again.groups == (FULL,)
    with raises_code(ErrorCode.FAILED_PRECONDITION, "stale epoch"):
        client.step(pool_id, first, [])
    _admit(client, pool_id, again.epoch, 1, list(range(12)))
    assert _grow(client, pool_id, again.epoch, 1, 9).first_live_blocks == ()  # full: keeps all
    assert _in_use(client, pool_id) == 6


# ---- release at Grow ----------------------------------------------------------------------------


def test_grow_releases_the_blocks_out_of_the_window(client, pool_id, max_groups):
    epoch = _register(client, pool_id, window=8)
    a = _admit(client, pool_id, epoch, 1, list(range(12)))
    assert 0 not in a.block_ids and len(a.block_ids) == 3
    g = _grow(client, pool_id, epoch, 1, 1)  # queries from 12 read (4, 12]: block 0 is out
    assert g.statuses == (OpStatus.OK,) and g.first_live_blocks == (1,)
    assert len(g.new_block_ids[0]) == 1 and _in_use(client, pool_id) == 3
    assert _grow(client, pool_id, epoch, 1, 2).first_live_blocks == (1,)  # from 13: (5, 13]
    g = _grow(client, pool_id, epoch, 1, 0)  # from 15: (7, 15] -> block 1 is out too
    assert g.first_live_blocks == (2,) and g.new_block_ids == ((),)
    c = client.stats(pool_id).counters
    assert (c.num_in_use_blocks, c.num_free_blocks) == (2, 13)


def test_blocks_released_by_a_grow_entry_pay_for_its_own_allocation(client, pool_id, max_groups):
    epoch = _register(client, pool_id, window=4, num_blocks=4)  # 3 usable
    _admit(client, pool_id, epoch, 1, list(range(12)))  # the pool is full
    g = _grow(client, pool_id, epoch, 1, 1)  # from 12: (8, 12] -> 2 released, 1 allocated
    assert g.statuses == (OpStatus.OK,) and g.first_live_blocks == (2,)
    assert _in_use(client, pool_id) == 2


def test_a_grow_entry_that_does_not_fit_releases_nothing(client, pool_id, max_groups):
    epoch = _register(client, pool_id, window=4, num_blocks=5)  # 4 usable
    _admit(client, pool_id, epoch, 1, list(range(12)))
    assert _step1(client, pool_id, epoch, Fork(1, 2)).status is OpStatus.OK  # shares all
    _admit(client, pool_id, epoch, 3, [7])  # the last free block
    g = _grow(client, pool_id, epoch, 1, 1)  # releasing shared blocks frees nothing
    assert g.statuses == (OpStatus.RESOURCE_EXHAUSTED,) and g.first_live_blocks == (0,)
    g = _grow(client, pool_id, epoch, 1, 0)  # nothing to allocate: releases
    assert g.statuses == (OpStatus.OK,) and g.first_live_blocks == (2,)
    fork = _step1(client, pool_id, epoch, Fork(1, 4))
    assert fork == ForkResult(OpStatus.OK, 1)  # only its live block is shared


# ---- admission ----------------------------------------------------------------------------------


def test_admission_nulls_the_entries_before_the_window_of_its_first_uncached_query(
    client, pool_id, max_groups
):
    epoch = _register(client, pool_id, window=8, num_blocks=32)
    history = list(range(24))
    a = _admit(client, pool_id, epoch, 1, history)
    assert _step1(client, pool_id, epoch, Commit(1, 0, hashes(history, BS))).status is (OpStatus.OK)
    r = _admit(client, pool_id, epoch, 2, [*history, 90, 91])  # queries from 24: (16, 24]
    assert r.num_cached_tokens == 24 and r.num_tokens == 26
    assert r.block_ids[:4] == (0, 0, 0, 0) and r.block_ids[4:6] == a.block_ids[4:6]
    assert r.block_ids[6] not in (0, *a.block_ids)
    assert _in_use(client, pool_id) == 7  # only the window's blocks are shared
    s = client.stats(pool_id)
    assert s.prefix_cache_hits_tokens == 24


def test_a_hit_needs_only_the_window_blocks_when_older_ones_were_evicted(
    client, pool_id, max_groups
):
    epoch = _register(client, pool_id, window=8, num_blocks=10)  # 9 usable
    prompt = list(range(24))
    a = _admit(client, pool_id, epoch, 1, prompt)
    h = hashes(prompt, BS)
    client.step(pool_id, epoch, [Commit(1, 0, h)])
    history = [*prompt, 50, 51, 52, 53]
    for _ in range(4):  # decode: blocks 0..4 fall out of the window
        _grow(client, pool_id, epoch, 1, 1)
    client.step(pool_id, epoch, [Commit(1, 6, hashes(history, BS)[6:]), Free((1,))])
    _admit(client, pool_id, epoch, 2, list(range(100, 120)))  # 5 blocks: 3 evictions
    assert client.stats(pool_id).num_evicted_blocks == 3
    r = _admit(client, pool_id, epoch, 3, [*history, 60, 61])
    assert r.num_cached_tokens == 28 and r.block_ids[:5] == (0,) * 5
    assert r.block_ids[5] == a.block_ids[5]


# ---- fork, free, commit, copy-on-write with null entries ---------------------------------------


def test_fork_free_and_commit_with_null_entries(client, pool_id, max_groups):
    epoch = _register(client, pool_id, window=4)
    tokens = list(range(13))
    _admit(client, pool_id, epoch, 1, tokens)
    assert _grow(client, pool_id, epoch, 1, 0).first_live_blocks == (2,)  # from 13: (9, 13]
    commit = _step1(client, pool_id, epoch, Commit(1, 0, hashes(tokens, BS)))
    assert commit == CommitResult(OpStatus.OK, 1)  # the 2 released blocks are skipped
    assert _step1(client, pool_id, epoch, Fork(1, 2)) == ForkResult(OpStatus.OK, 2)
    g = _grow(client, pool_id, epoch, 2, 1)  # copy-on-write of the shared last block
    assert g.first_live_blocks == (2,) and len(g.copies) == 1
    assert g.copies[0].block_index == 3 and 0 not in (g.copies[0].src, g.copies[0].dst)
    assert _step1(client, pool_id, epoch, Free((1,))) == FreeResult(1)  # its last block
    assert _step1(client, pool_id, epoch, Free((2,))) == FreeResult(2)
    assert _in_use(client, pool_id) == 0


# ---- restore ------------------------------------------------------------------------------------


def test_restore_accepts_a_leading_run_of_null_entries(client, pool_id, max_groups):
    epoch = _register(client, pool_id, window=4)
    tokens = list(range(13))
    res = client.restore(
        pool_id, epoch, [RestoredSequence(1, 13, (0, 0, 5, 6), hashes(tokens, BS))]
    )
    assert (res.num_sequences, res.num_stored_blocks) == (1, 1)  # null entries' hashes skipped
    assert res.counters.num_in_use_blocks == 2
    g = _grow(client, pool_id, epoch, 1, 4)
    assert g.statuses == (OpStatus.OK,) and g.first_live_blocks == (2,)
    assert _step1(client, pool_id, epoch, Free((1,))) == FreeResult(3)


@pytest.mark.parametrize(
    ("block_ids", "field"),
    [((5, 0, 6, 7), "reserved"), ((0, 0, 0, 0), "reserved"), ((0, 5, 5, 6), "twice")],
)
def test_restore_refuses_null_entries_that_are_not_a_leading_run(
    client, pool_id, max_groups, block_ids, field
):
    epoch = _register(client, pool_id, window=4)
    with raises_code(ErrorCode.INVALID_ARGUMENT, field):
        client.restore(pool_id, epoch, [RestoredSequence(1, 13, block_ids)])
    assert _in_use(client, pool_id) == 0


def test_restore_refuses_null_entries_in_a_full_pool(client, pool_id, max_groups):
    epoch = client.register(pool_id, PoolSpec(16, BS)).epoch
    with raises_code(ErrorCode.INVALID_ARGUMENT, "reserved"):
        client.restore(pool_id, epoch, [RestoredSequence(1, 13, (0, 0, 5, 6))])


# ---- eviction order -----------------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["lru", "lfu", "arc", "s3fifo", "reuse"])
def test_out_of_window_blocks_are_evicted_before_a_finished_sequences_last_window(
    client, pool_id, max_groups, policy
):
    """vllm#48435: a finished conversation's next turn (its whole history + a new message) must
    keep hitting its whole prefix while pressure evicts its older, out-of-window blocks."""
    if policy not in client.info().eviction_policies:
        pytest.skip(f"{policy} is not offered by this implementation")
    epoch = _register(client, pool_id, window=8, num_blocks=10, eviction_policy=policy)
    stream = client.events(pool_id)
    prompt = list(range(24))
    a = _admit(client, pool_id, epoch, 1, prompt)
    client.step(pool_id, epoch, [Commit(1, 0, hashes(prompt, BS))])
    history = [*prompt, 50, 51, 52, 53]
    h = hashes(history, BS)
    for _ in range(4):  # blocks 0..4 fall out of the window as it decodes
        _grow(client, pool_id, epoch, 1, 1)
    client.step(pool_id, epoch, [Commit(1, 6, h[6:]), Free((1,))])
    c = client.stats(pool_id).counters
    assert (c.num_in_use_blocks, c.num_cached_free_blocks) == (0, 7)
    # 5 blocks for another request: the 2 never-cached free blocks, then 3 evictions.
    _admit(client, pool_id, epoch, 2, list(range(100, 120)))
    events = collect_events(stream, until=lambda got: _removed(got) >= 3)
    removed = [x for e in events if e.kind is KVEventKind.REMOVED for x in e.block_hashes]
    assert sorted(removed) == sorted(h[:3])  # the oldest, released out of the window
    assert all(e.group == 0 for e in events)
    r = _admit(client, pool_id, epoch, 3, [*history, 60, 61])  # the next turn
    assert r.status is OpStatus.OK and r.num_cached_tokens == len(history)
    assert r.block_ids[:5] == (0,) * 5 and r.block_ids[5] == a.block_ids[5]
