"""The contract's hybrid pools: several KV-cache groups per pool (one table per group and
sequence, group-major on the wire, from one set of blocks), written once against
:class:`BlockManagerClient`.

Skipped against an implementation whose Info says ``max_kv_cache_groups < 2``. The pool used
here is Gemma-shaped: group 0 slides over 8 tokens, group 1 attends to everything. Asserts
contract behaviour only: table shapes, null entries, counts, hits, the eviction order of
released blocks; never our particular block ids.
"""

from __future__ import annotations

import pytest

from services.blockmgr.api.errors import ErrorCode
from services.blockmgr.api.protocol import BlockManagerClient
from services.blockmgr.api.types import (
    Admit,
    AdmitResult,
    AttentionKindName,
    Commit,
    Fork,
    ForkResult,
    Free,
    FreeResult,
    KVCacheGroup,
    KVEventKind,
    OpStatus,
    PoolSpec,
    RestoredSequence,
    SwapIn,
    SwapOut,
)
from tests.blockmgr.conformance.ops import BS
from tests.blockmgr.conformance.ops import admit as _admit
from tests.blockmgr.conformance.ops import grow as _grow
from tests.blockmgr.conformance.ops import in_use as _in_use
from tests.blockmgr.conformance.ops import step1 as _step1
from tests.blockmgr.helpers import collect_events, hashes, raises_code

WINDOW = 8
SLIDING = KVCacheGroup(AttentionKindName.SLIDING, WINDOW, (0, 1, 2, 4, 5))
FULL = KVCacheGroup(AttentionKindName.FULL, 0, (3,))
GROUPS = (SLIDING, FULL)


@pytest.fixture
def hybrid(client: BlockManagerClient) -> None:
    if client.info().max_kv_cache_groups < 2:
        pytest.skip("this implementation serves one KV-cache group per pool")


def _register(client, pool_id, num_blocks: int = 32, **kw) -> int:
    return client.register(
        pool_id, PoolSpec(num_blocks, BS, groups=tuple(list(GROUPS)), **kw)
    ).epoch


def _tables(block_ids: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    n = len(block_ids) // 2
    assert len(block_ids) == 2 * n
    return block_ids[:n], block_ids[n:]


def _finished_turn(client, pool_id, epoch) -> tuple[list[int], AdmitResult]:
    """One conversation's turn in a pool of 17 usable blocks: a 24-token prompt, 4 tokens
    decoded (the sliding group releases its blocks 0..4 on the way), committed and freed.
    Afterwards 14 blocks are cached-free: the 5 released ones first in the eviction order,
    then the sliding group's last window (5, 6), then the full group's 7 blocks. 3 blocks
    were never cached."""
    prompt = list(range(24))
    a = _admit(client, pool_id, epoch, 1, prompt)
    client.step(pool_id, epoch, [Commit(1, 0, hashes(prompt, BS))])
    history = [*prompt, 50, 51, 52, 53]
    for _ in range(4):
        _grow(client, pool_id, epoch, 1, 1)
    client.step(pool_id, epoch, [Commit(1, 6, hashes(history, BS)[6:]), Free((1,))])
    c = client.stats(pool_id).counters
    assert (c.num_in_use_blocks, c.num_cached_free_blocks, c.num_free_blocks) == (0, 14, 17)
    return history, a


# ---- registration -------------------------------------------------------------------------------


def test_a_hybrid_pool_is_echoed_by_register_info_and_stats(client, pool_id, hybrid):
    info = client.register(pool_id, PoolSpec(16, BS, groups=tuple(list(GROUPS))))
    assert info.groups == GROUPS
    assert client.info(pool_id).pools[0].groups == GROUPS
    assert client.stats(pool_id).pool.groups == GROUPS


def test_a_layer_in_two_groups_is_invalid_argument(client, pool_id, hybrid):
    twice = KVCacheGroup(AttentionKindName.FULL, 0, (3, 1))
    with raises_code(ErrorCode.INVALID_ARGUMENT, "groups[1].layers[1]"):
        client.register(pool_id, PoolSpec(16, BS, groups=tuple([SLIDING, twice])))


# ---- admission and grow -------------------------------------------------------------------------


def test_admission_gives_every_group_a_table_of_equal_length_group_major(client, pool_id, hybrid):
    epoch = _register(client, pool_id)
    a = _admit(client, pool_id, epoch, 1, list(range(10)))
    assert a.status is OpStatus.OK and a.num_tokens == 10
    sliding, full = _tables(a.block_ids)
    assert len(sliding) == len(full) == 3
    assert 0 not in a.block_ids and len(set(a.block_ids)) == 6  # no block in two groups
    assert _in_use(client, pool_id) == 6


def test_an_admission_that_does_not_fit_every_group_allocates_nothing(client, pool_id, hybrid):
    epoch = _register(client, pool_id, num_blocks=6)  # 5 usable: 3 blocks a group do not fit
    assert _admit(client, pool_id, epoch, 1, list(range(10))).status is (
        OpStatus.RESOURCE_EXHAUSTED
    )
    assert _in_use(client, pool_id) == 0
    assert _admit(client, pool_id, epoch, 2, list(range(8))).status is OpStatus.OK  # 2 + 2


def test_grow_releases_only_in_the_sliding_group(client, pool_id, hybrid):
    epoch = _register(client, pool_id)
    _admit(client, pool_id, epoch, 1, list(range(12)))
    g = _grow(client, pool_id, epoch, 1, 1)  # queries from 12 read (4, 12]: block 0 is out
    assert g.statuses == (OpStatus.OK,)
    assert g.first_live_blocks == (1, 0)  # per entry and group
    new_sliding, new_full = _tables(g.new_block_ids[0])
    assert len(new_sliding) == len(new_full) == 1
    assert _in_use(client, pool_id) == 3 + 4
    g = _grow(client, pool_id, epoch, 1, 2)  # from 13: (5, 13]: block 1 stays
    assert g.first_live_blocks == (1, 0) and g.new_block_ids == ((),)
    g = _grow(client, pool_id, epoch, 1, 5)  # from 15: (7, 15]: block 1 is out; 20 slots
    assert g.first_live_blocks == (2, 0) and len(g.new_block_ids[0]) == 2
    assert _in_use(client, pool_id) == 3 + 5


def test_a_grow_entry_is_all_or_nothing_across_groups(client, pool_id, hybrid):
    epoch = _register(client, pool_id, num_blocks=8)  # 7 usable
    _admit(client, pool_id, epoch, 1, list(range(8)))  # 2 + 2
    _admit(client, pool_id, epoch, 2, [7, 8, 9])  # 1 + 1: one block left
    g = _grow(client, pool_id, epoch, 1, 1)  # needs one block in each group
    assert g.statuses == (OpStatus.RESOURCE_EXHAUSTED,) and g.first_live_blocks == (0, 0)
    assert _in_use(client, pool_id) == 6
    client.step(pool_id, epoch, [Free((2,))])
    g = _grow(client, pool_id, epoch, 1, 1)
    assert g.statuses == (OpStatus.OK,) and _in_use(client, pool_id) == 6


# ---- prefix hits across groups and the eviction order -------------------------------------------


def test_the_next_turn_hits_its_whole_prefix_in_every_group(client, pool_id, hybrid):
    epoch = _register(client, pool_id, num_blocks=18)
    history, a = _finished_turn(client, pool_id, epoch)
    r = _admit(client, pool_id, epoch, 3, [*history, 60, 61])  # queries from 28: (20, 28]
    assert r.num_cached_tokens == 28 and r.num_tokens == 30
    sliding, full = _tables(r.block_ids)
    assert sliding[:5] == (0,) * 5 and 0 not in sliding[5:] and 0 not in full
    first_sliding, first_full = _tables(a.block_ids)
    assert full[:6] == first_full and sliding[5] == first_sliding[5]


@pytest.mark.parametrize("policy", ["lru", "lfu", "arc", "s3fifo"])
def test_released_blocks_are_evicted_before_the_blocks_the_next_turn_needs(
    client, pool_id, hybrid, policy
):
    """vllm#48435 in a hybrid pool: pressure between turns evicts the sliding group's
    out-of-window blocks first, so the next turn still hits its whole history."""
    if policy not in client.info().eviction_policies:
        pytest.skip(f"{policy} is not offered by this implementation")
    epoch = _register(client, pool_id, num_blocks=18, eviction_policy=policy)
    stream = client.events(pool_id)
    history, _ = _finished_turn(client, pool_id, epoch)
    h = hashes(history, BS)
    # 4 blocks a group for another request: the 3 never-cached blocks, then 5 evictions.
    assert _admit(client, pool_id, epoch, 2, list(range(100, 116))).status is OpStatus.OK
    events = collect_events(
        stream,
        until=lambda got: (
            sum(len(e.block_hashes) for e in got if e.kind is KVEventKind.REMOVED) >= 5
        ),
    )
    removed = [
        (x, e.group) for e in events if e.kind is KVEventKind.REMOVED for x in e.block_hashes
    ]
    assert sorted(removed) == sorted((x, 0) for x in h[:5])  # the sliding group's released ones
    client.step(pool_id, epoch, [Free((2,))])
    r = _admit(client, pool_id, epoch, 3, [*history, 60, 61])
    assert r.status is OpStatus.OK and r.num_cached_tokens == 28


def test_a_hit_is_only_as_long_as_every_group_serves(client, pool_id, hybrid):
    epoch = _register(client, pool_id, num_blocks=18)
    history, _ = _finished_turn(client, pool_id, epoch)
    _admit(client, pool_id, epoch, 2, list(range(100, 116)))  # evicts sliding blocks 0..4
    client.step(pool_id, epoch, [Free((2,))])
    # The full group still holds blocks 0..3 of this prompt, but the sliding group's window
    # at every k <= 4 reaches an evicted block: no hit at all.
    r = _admit(client, pool_id, epoch, 3, [*history[:16], 70, 71, 72, 73, 74])
    assert r.status is OpStatus.OK and r.num_cached_tokens == 0


# ---- fork, copy-on-write, commit, free, events --------------------------------------------------


def test_fork_shares_every_group_and_copy_on_write_names_the_group(client, pool_id, hybrid):
    epoch = _register(client, pool_id)
    _admit(client, pool_id, epoch, 1, list(range(6)))  # 2 blocks a group, the last partial
    assert _step1(client, pool_id, epoch, Fork(1, 2)) == ForkResult(OpStatus.OK, 4)
    g = _grow(client, pool_id, epoch, 2, 1)
    assert sorted(c.group for c in g.copies) == [0, 1]
    assert all(c.block_index == 1 and c.entry == 0 for c in g.copies)
    assert _in_use(client, pool_id) == 6
    assert _step1(client, pool_id, epoch, Free((1, 2))) == FreeResult(6)


def test_commit_stores_every_groups_block_and_events_name_the_group(client, pool_id, hybrid):
    epoch = _register(client, pool_id)
    stream = client.events(pool_id)
    tokens = list(range(9))
    _admit(client, pool_id, epoch, 1, tokens)
    commit = _step1(client, pool_id, epoch, Commit(1, 0, hashes(tokens, BS)))
    assert commit.status is OpStatus.OK and commit.num_stored_blocks == 4
    events = collect_events(
        stream,
        until=lambda got: (
            sum(len(e.block_hashes) for e in got if e.kind is KVEventKind.STORED) >= 4
        ),
    )
    stored = sorted(
        (x, e.group) for e in events if e.kind is KVEventKind.STORED for x in e.block_hashes
    )
    h = hashes(tokens, BS)
    assert stored == sorted([(x, g) for x in h for g in (0, 1)])


# ---- restore ------------------------------------------------------------------------------------


def test_restore_rebuilds_hybrid_tables_group_major(client, pool_id, hybrid):
    epoch = _register(client, pool_id)
    tokens = list(range(13))
    # Sliding group: blocks 0, 1 released; full group: all four.
    seq = RestoredSequence(1, 13, (0, 0, 5, 6, 7, 8, 9, 10), hashes(tokens, BS))
    res = client.restore(pool_id, epoch, [seq])
    assert (res.num_sequences, res.num_stored_blocks) == (1, 1 + 3)
    assert res.counters.num_in_use_blocks == 6
    g = _grow(client, pool_id, epoch, 1, 4)
    assert g.statuses == (OpStatus.OK,) and g.first_live_blocks == (2, 0)
    assert _step1(client, pool_id, epoch, Free((1,))) == FreeResult(3 + 5)


@pytest.mark.parametrize(
    ("block_ids", "field"),
    [
        ((0, 0, 5, 6, 7, 8, 9), "need 4 blocks in each of 2"),  # one short
        ((0, 0, 5, 6, 0, 8, 9, 10), "reserved"),  # a null entry in the full group
        ((0, 0, 5, 6, 7, 8, 9, 5), "serves one group"),  # block 5 in both groups
    ],
)
def test_restore_refuses_tables_that_break_the_hybrid_rules(
    client, pool_id, hybrid, block_ids, field
):
    epoch = _register(client, pool_id)
    with raises_code(ErrorCode.INVALID_ARGUMENT, field):
        client.restore(pool_id, epoch, [RestoredSequence(1, 13, block_ids)])
    assert _in_use(client, pool_id) == 0


def test_restore_refuses_a_block_in_two_groups_across_sequences(client, pool_id, hybrid):
    epoch = _register(client, pool_id)
    a = RestoredSequence(1, 4, (5, 6))
    b = RestoredSequence(2, 4, (7, 5))  # block 5: sliding in sequence 1, full here
    with raises_code(ErrorCode.INVALID_ARGUMENT, "sequences[1].block_ids[1]"):
        client.restore(pool_id, epoch, [a, b])
    assert _in_use(client, pool_id) == 0


# ---- tiers below the device -------------------------------------------------------------------


def test_a_hybrid_pool_onboards_every_groups_hit_from_the_host_tier(client, pool_id, hybrid):
    """A conversation evicted from the device by another request is offloaded, group by
    group, and its next turn hits its whole history again, its blocks onboarded into the
    groups' tables (the sliding group only those its window reads)."""
    epoch = _register(client, pool_id, num_blocks=18, host_blocks=32)
    history, _ = _finished_turn(client, pool_id, epoch)
    # 8 blocks a group for another request: the 3 never-cached blocks, then 13 of the 14
    # cached ones are evicted (all but the full group's most recently freed), offloaded.
    prompt = list(range(100, 132))
    other = client.step(pool_id, epoch, [Admit(2, 32, 32, hashes(prompt, BS))])
    assert other.results[0].status is OpStatus.OK
    assert len({m.host_slot for m in other.offloads}) == len(other.offloads) == 13
    client.step(pool_id, epoch, [Free((2,))])
    again = client.step(pool_id, epoch, [Admit(3, 30, 2, hashes([*history, 60, 61], BS))])
    (r,) = again.results
    assert r.status is OpStatus.OK and r.num_cached_tokens == 28  # as if never evicted
    sliding, full = _tables(r.block_ids)
    assert sliding[:5] == (0,) * 5 and 0 not in sliding[5:] and 0 not in full
    # The hit blocks not still on the device come from the tier: 6 full and 2 sliding ones.
    onboarded = {m.device_block for m in again.onboards}
    assert len(onboarded) == len(again.onboards) == 8
    assert onboarded <= {*full[:7], *sliding[5:7]}
    assert client.stats(pool_id).host_hits_tokens == 8 * BS


def test_a_hybrid_sequence_swaps_out_and_back_in_with_its_released_entries(client, pool_id, hybrid):
    """A Gemma-shaped sequence, its sliding group past its window: SwapOut gives a slot to
    every live entry of both tables (-1 for the released ones), SwapIn gives back tables of
    the same shape, the same null entries, filled from those slots; a restart in between
    restores it from its slots."""
    epoch = _register(client, pool_id, host_blocks=32)
    _admit(client, pool_id, epoch, 1, list(range(24)))
    for _ in range(4):  # 28 tokens: the sliding group's blocks 0..4 are out of its window
        _grow(client, pool_id, epoch, 1, 1)
    (out,) = client.step(pool_id, epoch, [SwapOut((1,))]).results
    assert out.statuses == (OpStatus.OK,)
    slots = out.host_slots[0]
    assert slots[:5] == (-1,) * 5 and -1 not in slots[5:] and len(slots) == 14
    assert len(set(slots[5:])) == 9 and _in_use(client, pool_id) == 0
    # The block manager restarts (a new registration): the executor restores it, swapped out.
    epoch = _register(client, pool_id, host_blocks=32)
    client.restore(pool_id, epoch, [RestoredSequence(1, 28, (), (), slots)])
    back = client.step(pool_id, epoch, [SwapIn((1,))])
    (r,) = back.results
    assert r.statuses == (OpStatus.OK,)
    sliding, full = _tables(r.block_ids[0])
    assert sliding[:5] == (0,) * 5 and 0 not in sliding[5:] and 0 not in full
    assert sorted(m.host_slot for m in back.onboards) == sorted(slots[5:])
    assert {m.device_block for m in back.onboards} == {*sliding[5:], *full}
    _grow(client, pool_id, epoch, 1, 1)  # a live sequence again
    with raises_code(ErrorCode.INVALID_ARGUMENT, "host_slots[7]"):  # the full group's
        bad = (*slots[:7], -1, *slots[8:])
        client.restore(
            pool_id,
            _register(client, pool_id, host_blocks=32),
            [RestoredSequence(2, 28, (), (), bad)],
        )
