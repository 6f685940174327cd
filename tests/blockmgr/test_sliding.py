"""Our core's exact behaviour in sliding-window pools: which blocks are released and when, the
prefix hit that needs only the window's blocks, and the eviction order of released blocks."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.blockmgr.api.errors import ErrorCode
from services.blockmgr.api.types import (
    FULL_GROUP,
    Admit,
    AttentionKindName,
    Commit,
    Fork,
    Free,
    Grow,
    GrowResult,
    KVCacheGroup,
    OpStatus,
    PoolSpec,
    RestoredSequence,
)
from services.blockmgr.pool.groups import (
    MAX_KV_CACHE_GROUPS,
    longest_group_hit,
    longest_window_hit,
    split_key,
    validated_groups,
)
from services.blockmgr.pool.manager import KVBlockManager
from services.blockmgr.service.core import BlockManagerCore
from services.common.blocks import first_live_block as first_live
from tests.blockmgr.helpers import hashes, raises_code
from tests.hypothesis_budget import examples

BS = 4
SLIDING = AttentionKindName.SLIDING


def _sliding(num_blocks: int, window: int, policy: str = "lru") -> KVBlockManager:
    return KVBlockManager(
        PoolSpec(
            num_blocks,
            BS,
            groups=(KVCacheGroup(AttentionKindName.SLIDING, window),),
            eviction_policy=policy,
        )
    )


def _admit(m: KVBlockManager, seq_id: int, tokens: list[int], budget: int = 10**6):
    (r,) = m.step([Admit(seq_id, len(tokens), budget, hashes(tokens, BS))])
    return r


def _grow(m: KVBlockManager, seq_id: int, n: int) -> GrowResult:
    (r,) = m.step([Grow((seq_id,), (n,))])
    assert isinstance(r, GrowResult)
    return r


def _live(m: KVBlockManager, seq_id: int) -> list[int]:
    return [b for b in m.block_table(seq_id) if b]


# ---- the window arithmetic -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("pos", "window", "expected"),
    [(0, 8, 0), (7, 8, 0), (11, 8, 1), (12, 8, 1), (15, 8, 2), (4, 1, 1), (3, 1, 0), (9, 0, 0)],
)
def test_first_live_is_the_first_block_a_query_at_pos_still_reads(pos, window, expected):
    assert first_live(pos, window, BS) == expected


@settings(max_examples=examples(150), deadline=None, derandomize=True)
@given(
    cached=st.sets(st.integers(0, 11)),
    n=st.integers(0, 12),
    window=st.integers(1, 20),
)
def test_longest_window_hit_equals_the_brute_force_search(cached, n, window):
    block_hashes = [bytes([i]) * 32 for i in range(n)]
    lookups: list[int] = []

    def lookup(h: bytes) -> int | None:
        lookups.append(h[0])
        return 100 + h[0] if h[0] in cached else None

    k, ids = longest_window_hit(block_hashes, window, BS, lookup)
    best = max(
        (
            k2
            for k2 in range(n + 1)
            if all(j in cached for j in range(first_live(k2 * BS, window, BS), k2))
        ),
        default=0,
    )
    assert k == best
    assert ids == [100 + j for j in range(first_live(k * BS, window, BS), k)]
    assert len(lookups) == len(set(lookups)) <= n  # every block looked up at most once


@settings(max_examples=examples(80), deadline=None, derandomize=True)
@given(
    cached=st.sets(st.tuples(st.integers(0, 2), st.integers(0, 11))),
    n=st.integers(0, 12),
    windows=st.lists(st.sampled_from([0, 1, 4, 6, 9]), min_size=1, max_size=3),
)
def test_longest_group_hit_is_the_longest_prefix_every_group_serves(cached, n, windows):
    """Against brute force: a full group needs blocks 0..k-1 cached in it, a sliding one the
    blocks its window reads at k; each (hash, group) key is looked up at most once."""
    block_hashes = [bytes([i]) * 32 for i in range(n)]
    lookups: list[bytes] = []

    def lookup(key: bytes) -> int | None:
        lookups.append(key)
        block, group = split_key(key)
        return 1000 * group + block[0] + 1 if (group, block[0]) in cached else None

    k, lives, hits = longest_group_hit(block_hashes, windows, BS, lookup)

    def serves(g: int, w: int, k2: int) -> bool:
        return all((g, j) in cached for j in range(first_live(k2 * BS, w, BS), k2))

    best = max(
        (k2 for k2 in range(n + 1) if all(serves(g, w, k2) for g, w in enumerate(windows))),
        default=0,
    )
    assert k == best
    assert lives == [first_live(k * BS, w, BS) for w in windows]
    assert hits == [[1000 * g + j + 1 for j in range(lives[g], k)] for g in range(len(windows))]
    assert len(lookups) == len(set(lookups))


@settings(max_examples=examples(40), deadline=None, derandomize=True)
@given(window=st.integers(1, 70), bs=st.sampled_from([1, 2, 4, 16]), prompt=st.integers(1, 50))
def test_a_decoding_sequence_never_holds_more_than_the_window_plus_one_block(window, bs, prompt):
    m = KVBlockManager(PoolSpec(600, bs, groups=(KVCacheGroup(AttentionKindName.SLIDING, window),)))
    m.step([Admit(1, prompt, prompt)])
    bound = -(-window // bs) + 1
    for _ in range(400 - prompt):
        (g,) = m.step([Grow((1,), (1,))])
        assert g.statuses == (OpStatus.OK,)
        s = m.seqs[1]
        assert len(s.block_table) == -(-s.num_tokens // bs)
        assert len(s.block_table) - s.first_live <= bound


def test_w32_bs16_decoding_400_tokens_holds_at_most_3_blocks():
    m = KVBlockManager(PoolSpec(64, 16, groups=(KVCacheGroup(AttentionKindName.SLIDING, 32),)))
    m.step([Admit(1, 1, 1)])
    most = 0
    for _ in range(399):
        m.step([Grow((1,), (1,))])
        most = max(most, len(_live(m, 1)))
    assert most == 3 and m.seqs[1].num_tokens == 400
    assert m.counters().num_in_use_blocks == len(_live(m, 1)) <= 3


# ---- release at Grow -----------------------------------------------------------------------------


def test_grow_releases_the_blocks_out_of_the_window_of_its_queries():
    m = _sliding(16, window=8)
    assert _admit(m, 1, list(range(12))).block_ids == (1, 2, 3)
    g = _grow(m, 1, 1)  # queries from 12 read (4, 12]: block 0 (tokens 0..3) is out
    assert g.first_live_blocks == (1,) and g.new_block_ids == ((4,),)
    assert m.block_table(1) == [0, 2, 3, 4]
    assert m.pool.refcount[1] == 0 and 1 in m.pool.free_block_ids()
    g = _grow(m, 1, 0)  # queries from 13 read (5, 13]: block 1 still needed
    assert g.first_live_blocks == (1,) and m.block_table(1) == [0, 2, 3, 4]
    g = _grow(m, 1, 2)  # from 13 still: block 1 is read until the queries start at 15
    assert g.first_live_blocks == (1,)
    g = _grow(m, 1, 0)  # from 15: (7, 15] -> block 2 onwards
    assert g.first_live_blocks == (2,) and m.block_table(1) == [0, 0, 3, 4]
    assert m.counters().num_in_use_blocks == 2


def test_a_full_pool_grow_reports_no_first_live_blocks():
    m = KVBlockManager(PoolSpec(16, BS))
    _admit(m, 1, list(range(40)))
    assert _grow(m, 1, 1).first_live_blocks == ()
    assert 0 not in m.block_table(1)


def test_blocks_released_by_an_entry_pay_for_its_own_allocation():
    m = _sliding(4, window=4)  # 3 usable
    _admit(m, 1, list(range(12)))  # 3 blocks: the pool is full
    g = _grow(m, 1, 1)  # from 12: (8, 12] -> blocks 0 and 1 are released, one new block
    assert g.statuses == (OpStatus.OK,) and g.first_live_blocks == (2,)
    assert m.block_table(1) == [0, 0, 3, 1]  # the first one it freed
    assert m.counters().num_free_blocks == 1


def test_blocks_released_by_an_entry_pay_for_later_entries_of_the_step():
    m = _sliding(5, window=4)  # 4 usable
    _admit(m, 1, list(range(12)))  # 3 blocks
    _admit(m, 2, [7])  # 1 block: the pool is full
    (g,) = m.step([Grow((1, 2), (0, 4))])  # seq 1 releases 2 blocks; seq 2 needs 1
    assert g.statuses == (OpStatus.OK, OpStatus.OK)
    assert g.first_live_blocks == (2, 0)
    assert g.new_block_ids[0] == () and len(g.new_block_ids[1]) == 1


def test_a_grow_entry_that_does_not_fit_releases_nothing():
    m = _sliding(5, window=4)  # 4 usable
    _admit(m, 1, list(range(12)))  # 3 blocks
    m.step([Fork(1, 2)])  # its blocks are shared: releasing them frees nothing
    _admit(m, 3, [5])  # the last free block
    (g,) = m.step([Grow((1,), (1,)), Grow((1,), (1,))])[0:1]
    assert g.statuses == (OpStatus.RESOURCE_EXHAUSTED,) and g.first_live_blocks == (0,)
    assert m.block_table(1) == [1, 2, 3] and m.seqs[1].first_live == 0
    # A grow by 0 allocates nothing and only releases: it succeeds.
    g = _grow(m, 1, 0)
    assert g.statuses == (OpStatus.OK,) and g.first_live_blocks == (2,)
    assert m.block_table(1) == [0, 0, 3] and m.pool.refcount[1:4] == [1, 1, 2]


def test_a_skipped_entry_reports_its_unchanged_first_live():
    m = _sliding(16, window=4)
    _admit(m, 1, list(range(12)))
    _grow(m, 1, 1)  # first_live 2
    r = m.step([Admit(2, 200, 200), Grow((2, 1), (1, 1))])
    assert r[0].status is OpStatus.RESOURCE_EXHAUSTED
    assert r[1].statuses == (OpStatus.SKIPPED, OpStatus.OK)
    assert r[1].first_live_blocks == (0, 2)


def test_released_committed_blocks_stay_matchable_until_evicted():
    m = _sliding(16, window=8)
    tokens = list(range(16))
    _admit(m, 1, tokens)
    m.step([Commit(1, 0, hashes(tokens, BS))])
    _grow(m, 1, 1)  # from 16: (8, 16] -> blocks 0 and 1 released, still cached
    assert m.pool.num_cached_free == 2
    assert [m.pool.lookup(h) for h in hashes(tokens, BS)] == [1, 2, 3, 4]


# ---- admission -----------------------------------------------------------------------------------


def test_admission_references_only_the_window_of_its_first_uncached_query():
    m = _sliding(32, window=8)
    history = list(range(24))
    a = _admit(m, 1, history)
    m.step([Commit(1, 0, hashes(history, BS)), Free((1,))])
    r = _admit(m, 2, [*history, 90, 91])  # 6 full blocks hit; queries from 24 read (16, 24]
    assert r.num_cached_tokens == 24 and r.num_tokens == 26
    assert r.block_ids[:4] == (0, 0, 0, 0) and r.block_ids[4:6] == a.block_ids[4:6]
    assert m.seqs[2].first_live == 4
    assert [m.pool.refcount[b] for b in a.block_ids] == [0, 0, 0, 0, 1, 1]
    s = m.pool
    assert s.num_cached_free == 4  # the 4 old blocks were not taken back


def test_admission_hits_when_only_the_window_blocks_are_still_cached():
    m = _sliding(10, window=8)  # 9 usable
    history = list(range(24))
    a = _admit(m, 1, history)  # blocks 1..6
    m.step([Commit(1, 0, hashes(history, BS)), Free((1,))])  # freed oldest first
    _admit(m, 2, list(range(100, 124)))  # 3 never used blocks, then evicts 1, 2, 3
    assert [m.pool.lookup(h) for h in hashes(history, BS)] == [None] * 3 + [4, 5, 6]
    r = _admit(m, 3, [*history, 90])  # queries from 24 read (16, 24]: blocks 4 and 5
    # Its new block evicts block 4: out of the window of 24, it is not needed.
    assert r.num_cached_tokens == 24 and r.block_ids == (0, 0, 0, 0, *a.block_ids[4:6], 4)
    assert m.prefix_hits_tokens == 24


# ---- fork, free, commit with null entries --------------------------------------------------------


def test_fork_copies_null_entries_and_free_skips_them():
    m = _sliding(16, window=4)
    _admit(m, 1, list(range(12)))
    _grow(m, 1, 1)  # [0, 0, 3, 4]
    (f,) = m.step([Fork(1, 2)])
    assert f.num_shared_blocks == 2
    assert m.block_table(2) == [0, 0, 3, 4] and m.seqs[2].first_live == 2
    assert m.pool.refcount[3:5] == [2, 2]
    (free,) = m.step([Free((1,))])
    assert free.num_freed_blocks == 0
    (free,) = m.step([Free((2,))])
    assert free.num_freed_blocks == 2 and m.counters().num_in_use_blocks == 0


def test_commit_of_a_released_block_is_skipped_without_error():
    m = _sliding(16, window=4)
    tokens = list(range(13))
    _admit(m, 1, tokens)
    _grow(m, 1, 0)  # from 13: (9, 13] -> blocks 0, 1 released
    (c,) = m.step([Commit(1, 0, hashes(tokens, BS))])
    assert c.status is OpStatus.OK and c.num_stored_blocks == 1  # only block 2
    assert m.pool.lookup(hashes(tokens, BS)[2]) == 3
    assert m.pool.lookup(hashes(tokens, BS)[0]) is None


def test_copy_on_write_of_a_shared_last_block_after_release():
    m = _sliding(16, window=4)
    _admit(m, 1, list(range(10)))  # 3 blocks, the last holds 2 tokens
    m.step([Fork(1, 2)])
    g = _grow(m, 2, 1)  # from 10: (6, 10] -> block 0 released by seq 2 only; copy block 2
    assert g.first_live_blocks == (1,) and len(g.copies) == 1
    assert g.copies[0].block_index == 2 and g.copies[0].src == 3
    assert m.block_table(2)[:2] == [0, 2] and m.block_table(1) == [1, 2, 3]


# ---- eviction order ------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["lru", "lfu", "arc", "s3fifo", "reuse"])
def test_out_of_window_blocks_are_evicted_before_a_finished_sequences_last_window(policy):
    """vllm#48435: the next turn of a finished conversation (its whole history + a new message)
    must still hit its whole prefix when memory pressure evicts some of its blocks."""
    m = _sliding(10, window=8, policy=policy)  # 9 usable
    prompt = list(range(24))
    a = _admit(m, 1, prompt)  # blocks 1..6
    m.step([Commit(1, 0, hashes(prompt, BS))])
    history = [*prompt, 50, 51, 52, 53]  # decode 4 tokens: 7 blocks, the last one full
    for _ in range(4):
        _grow(m, 1, 1)
    m.step([Commit(1, 6, hashes(history, BS)[6:])])
    assert m.block_table(1)[:5] == [0] * 5  # from 27: (19, 27] -> block 5 onwards
    m.step([Free((1,))])  # last window: blocks 6 and 7 (index 5, 6)
    assert m.counters().num_cached_free_blocks == 7
    _admit(m, 2, list(range(100, 120)))  # 5 blocks: 2 never used, then 3 evictions
    evicted = [h for h in hashes(history, BS) if m.pool.lookup(h) is None]
    assert evicted == list(hashes(history, BS)[:3])  # the oldest, released out of the window
    r = _admit(m, 3, [*history, 60, 61])  # the next turn
    assert r.status is OpStatus.OK and r.num_cached_tokens == len(history)
    assert r.block_ids[5:7] == (a.block_ids[5], m.pool.lookup(hashes(history, BS)[6]))


@pytest.mark.parametrize("policy", ["lru", "lfu", "arc", "s3fifo", "reuse"])
def test_a_conversation_keeps_hitting_its_whole_history_turn_after_turn(policy):
    m = _sliding(24, window=8, policy=policy)
    history: list[int] = []
    for turn in range(5):
        seq_id = 10 + turn
        previous = len(history)
        history = [*history, *range(1000 * turn, 1000 * turn + 10)]  # a new message
        r = _admit(m, seq_id, history)
        assert r.status is OpStatus.OK and r.num_cached_tokens == previous // BS * BS
        m.step([Commit(seq_id, 0, hashes(history, BS))])  # after the prefill
        for j in range(6):  # the answer, its blocks committed as they fill
            _grow(m, seq_id, 1)
            history.append(500 + j)
            m.step([Commit(seq_id, 0, hashes(history, BS))])
        m.step([Free((seq_id,))])
        # Pressure from another request evicts blocks between turns.
        _admit(m, 90 + turn, list(range(7000 + 100 * turn, 7000 + 100 * turn + 60)))
        m.step([Free((90 + turn,))])
    assert m.pool.num_evicted > 0


# ---- registration and restore --------------------------------------------------------------------


def test_groups_are_validated_and_echoed():
    assert validated_groups(()) == (FULL_GROUP,)
    g = KVCacheGroup(SLIDING, 4096, (0, 2, 4))
    core = BlockManagerCore()
    info = core.register("p", PoolSpec(8, BS, groups=tuple([g])))
    assert info.groups == (g,) and core.info("p").pools[0].groups == (g,)
    assert core.manager("p").windows == (4096,)
    assert core.info().max_kv_cache_groups == MAX_KV_CACHE_GROUPS
    again = core.register("p", PoolSpec(8, BS), owner_token=info.owner_token)
    assert again.epoch > info.epoch and again.groups == (FULL_GROUP,)
    assert core.manager("p").windows == (0,)


@pytest.mark.parametrize(
    ("groups", "field"),
    [
        ([FULL_GROUP] * (MAX_KV_CACHE_GROUPS + 1), "groups"),
        ([KVCacheGroup(layers=(0, 1)), KVCacheGroup(SLIDING, 8, (2, 1))], "groups[1].layers[1]"),
        ([KVCacheGroup(SLIDING, 0)], "groups[0].sliding_window"),
        ([KVCacheGroup(SLIDING, -3)], "groups[0].sliding_window"),
        ([KVCacheGroup(AttentionKindName.FULL, 16)], "groups[0].sliding_window"),
        ([KVCacheGroup("chunked", 16)], "groups[0].kind"),  # type: ignore[arg-type]
        ([KVCacheGroup(SLIDING, 16, (1, -1))], "groups[0].layers[1]"),
    ],
)
def test_bad_groups_are_invalid_argument_naming_the_field(groups, field):
    core = BlockManagerCore()
    with raises_code(ErrorCode.INVALID_ARGUMENT, field):
        core.register("p", PoolSpec(8, BS, groups=tuple(groups)))
    assert core.info().pools == ()


def test_restore_accepts_leading_null_entries_in_a_sliding_pool_only():
    tokens = list(range(13))
    m = _sliding(16, window=4)
    stored = m.restore([RestoredSequence(1, 13, (0, 0, 5, 6), hashes(tokens, BS))])
    assert stored == 1  # the hashes of the null entries are skipped
    assert m.seqs[1].first_live == 2 and m.pool.refcount[5:7] == [1, 1]
    assert m.counters().num_in_use_blocks == 2
    assert _grow(m, 1, 4).first_live_blocks == (2,)
    full = KVBlockManager(PoolSpec(16, BS))
    with raises_code(ErrorCode.INVALID_ARGUMENT, "reserved"):
        full.restore([RestoredSequence(1, 13, (0, 0, 5, 6))])


@pytest.mark.parametrize(
    ("block_ids", "field"),
    [((5, 0, 6, 7), "block_ids[1]"), ((0, 0, 0, 0), "block_ids[3]"), ((0, 5, 5, 6), "twice")],
)
def test_restore_refuses_null_entries_that_are_not_a_leading_run(block_ids, field):
    m = _sliding(16, window=4)
    with raises_code(ErrorCode.INVALID_ARGUMENT, field):
        m.restore([RestoredSequence(1, 13, block_ids)])
    assert m.counters().num_in_use_blocks == 0


def test_a_window_of_one_may_release_every_block_and_restore_accepts_it():
    m = _sliding(8, window=1)
    _admit(m, 1, list(range(8)))
    assert _grow(m, 1, 0).first_live_blocks == (2,) and m.block_table(1) == [0, 0]
    fresh = _sliding(8, window=1)
    fresh.restore([RestoredSequence(1, 8, (0, 0))])
    assert _grow(fresh, 1, 1).new_block_ids == ((1,),)
