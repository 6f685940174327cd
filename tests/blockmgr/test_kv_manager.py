"""Our core's exact behaviour: block ids, free order, eviction order (not part of the contract,
but what our scheduler and benchmarks rely on)."""

from __future__ import annotations

from services.blockmgr.api.errors import ErrorCode
from services.blockmgr.api.types import (
    Admit,
    AttentionKindName,
    BlockCopy,
    Commit,
    Fork,
    Free,
    Grow,
    KVCacheGroup,
    KVEventKind,
    OpStatus,
    PoolSpec,
    RestoredSequence,
)
from services.blockmgr.pool.groups import group_key
from services.blockmgr.pool.manager import KVBlockManager
from services.blockmgr.service.core import BlockManagerCore
from tests.blockmgr.helpers import hashes, raises_code

BS = 4


def _admit(m: KVBlockManager, seq_id: int, tokens: list[int], budget: int = 10**6, salt=b""):
    (r,) = m.step([Admit(seq_id, len(tokens), budget, hashes(tokens, BS, salt))])
    return r


def _commit(m: KVBlockManager, seq_id: int, tokens: list[int], start: int = 0):
    m.step([Commit(seq_id, start, hashes(tokens, BS)[start:])])


def test_blocks_are_handed_out_in_id_order_starting_at_one():
    m = KVBlockManager(PoolSpec(8, BS))
    assert _admit(m, 1, list(range(9))).block_ids == (1, 2, 3)
    assert _admit(m, 2, list(range(2))).block_ids == (4,)
    (g,) = m.step([Grow((2,), (3,))])
    assert g.new_block_ids == ((5,),)


def test_uncached_freed_blocks_are_reused_fifo_after_never_used_ones():
    m = KVBlockManager(PoolSpec(6, BS))
    _admit(m, 1, list(range(8)))  # 1, 2
    m.step([Free((1,))])  # freed tail first: uncached queue is 3, 4, 5, 2, 1
    assert _admit(m, 2, list(range(20))).block_ids == (3, 4, 5, 2, 1)


def test_uncached_free_blocks_are_used_before_any_cached_block_is_evicted():
    m = KVBlockManager(PoolSpec(6, BS))
    tokens = list(range(8))
    _admit(m, 1, tokens)  # 1, 2
    _commit(m, 1, tokens)
    m.step([Free((1,))])
    assert m.pool.num_cached_free == 2
    assert _admit(m, 2, list(range(100, 112))).block_ids == (3, 4, 5)
    assert m.pool.num_evicted == 0


def test_lru_evicts_least_recently_freed_chain_tail_first():
    m = KVBlockManager(PoolSpec(7, BS))  # 6 usable
    a, b = list(range(8)), list(range(50, 58))
    _admit(m, 1, a)  # 1, 2
    _admit(m, 2, b)  # 3, 4
    _commit(m, 1, a)
    _commit(m, 2, b)
    m.step([Free((1,))])  # LRU queue: 2, 1
    m.step([Free((2,))])  # LRU queue: 2, 1, 4, 3
    assert _admit(m, 3, list(range(100, 116))).block_ids == (5, 6, 2, 1)
    assert m.pool.lookup(hashes(a, BS)[0]) is None
    assert m.pool.lookup(hashes(b, BS)[0]) == 3


def test_lfu_keeps_the_most_hit_prefix_under_pressure():
    m = KVBlockManager(PoolSpec(6, BS, eviction_policy="lfu"))  # 5 usable
    hot, cold = list(range(5)), list(range(50, 55))
    _admit(m, 1, hot)  # 1, 2
    _commit(m, 1, hot)
    for seq_id in (2, 3):  # two hits on the hot block 1
        assert _admit(m, seq_id, hot).num_cached_tokens == 4
    m.step([Free((1, 2, 3))])
    _admit(m, 4, cold)
    _commit(m, 4, cold)
    m.step([Free((4,))])  # cold freed last: LRU would evict hot's block 1 first
    (r,) = m.step([Admit(5, 16, 16)])
    assert r.status is OpStatus.OK
    assert m.pool.lookup(hashes(hot, BS)[0]) == 1
    assert m.pool.lookup(hashes(cold, BS)[0]) is None


def test_hit_on_free_cached_block_removes_it_from_the_eviction_queue():
    m = KVBlockManager(PoolSpec(5, BS))
    tokens = list(range(9))
    _admit(m, 1, tokens)  # 1, 2, 3
    _commit(m, 1, tokens)
    m.step([Free((1,))])
    r = _admit(m, 2, tokens)
    assert r.block_ids == (1, 2, 4)
    assert m.pool.refcount[1:4] == [1, 1, 0]
    assert m.pool.num_cached_free == 0
    # the only free blocks are 3 (uncached, freed) and none cached: the next grow takes 3
    (g,) = m.step([Grow((2,), (4,))])
    assert g.new_block_ids == ((3,),)


def test_commit_first_writer_wins_and_duplicates_stay_uncached():
    m = KVBlockManager(PoolSpec(8, BS))
    tokens = list(range(5))
    _admit(m, 1, tokens)  # 1, 2
    _admit(m, 2, tokens)  # 3, 4 (nothing committed yet)
    (c1,) = m.step([Commit(1, 0, hashes(tokens, BS))])
    (c2,) = m.step([Commit(2, 0, hashes(tokens, BS))])
    assert (c1.num_stored_blocks, c2.num_stored_blocks) == (1, 0)
    assert m.pool.block_hash[3] is None
    m.step([Free((2,))])
    assert m.pool.num_cached_free == 0


def test_cow_copy_replaces_the_last_block_of_the_writer_only():
    m = KVBlockManager(PoolSpec(8, BS))
    _admit(m, 1, list(range(6)))  # 1, 2
    m.step([Fork(1, 2)])
    (g,) = m.step([Grow((1, 2), (1, 1))])
    assert g.copies == (BlockCopy(0, 1, 2, 3),)
    assert m.seqs[1].block_table == [1, 3]
    assert m.seqs[2].block_table == [1, 2]
    assert m.pool.refcount[1:4] == [2, 1, 1]


def test_restore_takes_exactly_the_listed_blocks_out_of_the_free_queue():
    m = KVBlockManager(PoolSpec(8, BS))
    m.restore([RestoredSequence(1, 6, (5, 2)), RestoredSequence(2, 6, (5, 7))])
    assert m.pool.refcount == [0, 0, 1, 0, 0, 2, 0, 1]
    assert _admit(m, 3, list(range(12))).block_ids == (1, 3, 4)


def test_epochs_increase_and_are_unique_per_registration():
    core = BlockManagerCore()
    first = core.register("p", PoolSpec(4, BS))
    token = first.owner_token
    epochs = [first.epoch] + [
        core.register("p", PoolSpec(4, BS), owner_token=token).epoch for _ in range(2)
    ]
    assert epochs == sorted(epochs) and len(set(epochs)) == 3
    other = core.register("q", PoolSpec(4, BS)).epoch
    assert other > epochs[-1]
    with raises_code(ErrorCode.FAILED_PRECONDITION):
        core.step("p", epochs[0], [], token)


def test_readmitting_a_freed_sequence_id_is_allowed():
    m = KVBlockManager(PoolSpec(8, BS))
    _admit(m, 1, list(range(4)))
    m.step([Free((1,))])
    assert _admit(m, 1, list(range(4))).status is OpStatus.OK
    m.step([Free((1,))])
    with raises_code(ErrorCode.FAILED_PRECONDITION, "already freed"):
        m.step([Free((1,))])


def test_step_validation_sees_earlier_ops_of_the_same_step():
    m = KVBlockManager(PoolSpec(8, BS))
    # admit then grow then commit then free in one step: valid as a whole
    tokens = list(range(4))
    results = m.step(
        [
            Admit(1, 4, 4, hashes(tokens, BS)),
            Grow((1,), (4,)),
            Commit(1, 0, hashes(tokens, BS)),
            Fork(1, 2),
            Free((1, 2)),
        ]
    )
    assert [getattr(r, "status", OpStatus.OK) for r in results] == [OpStatus.OK] * 5
    assert m.counters().num_in_use_blocks == 0
    assert m.pool.num_cached_free == 1
    with raises_code(ErrorCode.FAILED_PRECONDITION, "freed earlier in this step"):
        m.step([Admit(3, 4, 4), Free((3,)), Grow((3,), (1,))])


def test_lfu_heap_stays_bounded_under_free_and_hit_churn():
    """Lazy deletion must not let the heap grow without bound: 20,000 free -> hit cycles of
    two cached blocks (issue 12 saw 40,002 heap entries)."""
    from services.blockmgr.eviction.policies import LFUPolicy

    policy = LFUPolicy()
    for _ in range(20_000):
        for block_id in (1, 2):
            policy.push(block_id)  # freed: cached and evictable
        for block_id in (1, 2):
            policy.remove(block_id)  # a prefix hit takes it back
    assert len(policy) == 0 and len(policy._heap) <= 64 + 2
    policy.push(7)
    policy.push(8)
    policy.remove(7)
    policy.push(7)  # one more hit than 8: 8 is evicted first
    assert policy.pop() == 8 and policy.pop() == 7


def test_a_consumer_resuming_after_a_restart_gets_every_new_event_from_cleared_on():
    """Sequence numbers do not restart at 1 with the process, and the new epoch announces
    itself: resuming with the last number seen before the restart misses nothing."""
    before = BlockManagerCore()
    info = before.register("p", PoolSpec(8, BS))
    tokens = list(range(8))
    before.step("p", info.epoch, [Admit(1, 9, 9, hashes(tokens, BS))], info.owner_token)
    before.step("p", info.epoch, [Commit(1, 0, hashes(tokens, BS))], info.owner_token)
    last_seen = before.stats("p").last_event_seq
    restarted = BlockManagerCore()  # the process came back empty
    again = restarted.register("p", PoolSpec(8, BS))
    replay = restarted.subscribe("p", lambda pool_id, events: None, start_after_seq=last_seen)
    assert [e.kind for e in replay] == [KVEventKind.CLEARED]
    assert replay[0].epoch == again.epoch and replay[0].seq > last_seen


def test_a_live_duplicate_takes_over_the_hash_when_the_hashed_copy_is_evicted():
    """Two identical prompts computed at once: only the first copy is hashed. Evicting it must
    not lose the hash while the second copy, holding the same KV, is alive."""
    m = KVBlockManager(PoolSpec(8, BS))  # 7 usable blocks
    tokens = list(range(8))  # two full blocks
    h = hashes(tokens, BS)
    _admit(m, 1, [*tokens, 99])
    _admit(m, 2, [*tokens, 99])  # no hit yet: nothing is committed
    m.step([Commit(1, 0, h), Commit(2, 0, h)])  # seq 1 wins; seq 2's blocks are copies
    copies = m.block_table(2)[:2]
    m.step([Free((1,))])  # seq 1's blocks: cached free, evictable
    m.pool.events.clear()
    _admit(m, 3, list(range(50, 63)))  # 4 blocks: the 2 uncached free, then seq 1's cached
    kinds = [k for k, _ in m.pool.events]
    assert kinds.count(KVEventKind.REMOVED) == 2 and kinds.count(KVEventKind.STORED) == 2
    assert [m.pool.lookup(x) for x in h] == copies  # still matchable, now on seq 2's copies
    m.step([Free((3,))])
    res = _admit(m, 4, [*tokens, 7])
    assert res.num_cached_tokens == 8 and res.block_ids[:2] == tuple(copies)


def test_a_hybrid_admission_never_allocates_a_block_another_of_its_groups_hit():
    """Regression: a sliding group's new blocks were allocated before the full group's hits
    were taken, so with no uncached block left the eviction could pick one of those hits:
    the two groups then listed the same block for different content (admission 10 below)."""
    base = [2, 1, 0, 1, 2, 0, 0, 2, 0, 2, 2, 0, 0, 2]
    script = [  # (seq id, prompt, max new tokens, then free this id)
        (1, [*base, 0], 4, 1),
        (2, [*base, 1, 0, 2], 4, None),
        (3, [*base[:10], 0, 2], 3, 2),
        (4, [*base[:8], 1, 0, 2, 1], 1, None),
        (5, base[:8], 1, None),
        (6, [*base, 1], 4, None),
        (7, [*base[:7], 1], 3, 6),
        (8, [2, 1, 0, 1, 2, 0, 1, 2, 2, 2, 1, 2], 4, 3),
        (9, [*base, 1, 2, 1, 0, 0, 1, 0, 2], 4, 8),
        (10, [*base, 1, 0, 0, 2], 3, 4),
    ]
    groups = [KVCacheGroup(AttentionKindName.SLIDING, 6), KVCacheGroup()]
    m = KVBlockManager(PoolSpec(14, BS, groups=tuple(groups)))
    for seq_id, prompt, new, free in script:
        h = hashes(prompt, BS)
        (r,) = m.step([Admit(seq_id, len(prompt), new, h)])
        if r.status is OpStatus.OK:
            n = len(r.block_ids) // 2
            sliding, full = r.block_ids[:n], r.block_ids[n:]
            assert not (set(sliding) - {0}) & set(full), (seq_id, sliding, full)
            for i in range(r.num_cached_tokens // BS):  # every hit holds its group's content
                assert m.pool.block_hash[full[i]] == group_key(h[i], 1)
            m.step([Commit(seq_id, 0, h[: r.num_tokens // BS])])
        if free is not None:
            m.step([Free((free,))])
