"""The block-manager contract, written once against :class:`BlockManagerClient`.

Runs against our in-process core, our gRPC server on loopback, and any implementation given
with ``--blockmgr-address host:port``. It asserts contract behaviour (counts, sharing, hits,
copy-on-write, errors), not our particular choice of block ids.
"""

from __future__ import annotations

import pytest

from services.blockmgr.api.errors import ErrorCode
from services.blockmgr.api.protocol import BlockManagerClient
from services.blockmgr.api.types import (
    Admit,
    AdmitResult,
    Commit,
    CommitResult,
    Fork,
    ForkResult,
    Free,
    Grow,
    GrowResult,
    KVEventKind,
    OpStatus,
    PoolSpec,
    RestoredSequence,
)
from tests.blockmgr.conformance.ops import BS
from tests.blockmgr.conformance.ops import admit as _admit
from tests.blockmgr.conformance.ops import free as _free
from tests.blockmgr.conformance.ops import grow as _grow
from tests.blockmgr.helpers import collect_events, hashes, raises_code


def _register(client: BlockManagerClient, pool_id: str, num_blocks: int = 16, **kw) -> int:
    return client.register(pool_id, PoolSpec(num_blocks, BS, **kw)).epoch


def _counters(client, pool_id):
    return client.stats(pool_id).counters


# ---- info and registration --------------------------------------------------------------------


def test_info_reports_hash_algorithm_and_policies(client, pool_id):
    _register(client, pool_id)
    info = client.info(pool_id)
    assert info.hash_algorithm == "sha256-chain-v1"
    assert info.hash_size == 32
    assert "lru" in info.eviction_policies
    (pool,) = info.pools
    assert (pool.pool_id, pool.num_blocks, pool.block_size) == (pool_id, 16, BS)
    assert pool.num_usable_blocks == 15


def test_fresh_pool_has_every_block_but_block_zero_free(client, pool_id):
    _register(client, pool_id, num_blocks=8)
    c = _counters(client, pool_id)
    assert (c.num_usable_blocks, c.num_free_blocks, c.num_in_use_blocks) == (7, 7, 0)
    assert (c.num_cached_free_blocks, c.num_sequences) == (0, 0)


def test_reregistration_issues_newer_epoch_and_refuses_the_stale_one(client, pool_id):
    old = _register(client, pool_id)
    _admit(client, pool_id, old, 1, list(range(6)))
    new = _register(client, pool_id)
    assert new > old
    with raises_code(ErrorCode.FAILED_PRECONDITION, "stale epoch"):
        client.step(pool_id, old, [Grow((1,), (1,))])
    # The old epoch's allocations are gone.
    assert _counters(client, pool_id).num_in_use_blocks == 0
    with raises_code(ErrorCode.NOT_FOUND):
        client.step(pool_id, new, [Grow((1,), (1,))])


def test_unknown_pool_is_not_found_on_every_rpc(client):
    with raises_code(ErrorCode.NOT_FOUND):
        client.step("no-such-pool", 1, [])
    with raises_code(ErrorCode.NOT_FOUND):
        client.stats("no-such-pool")
    with raises_code(ErrorCode.NOT_FOUND):
        client.info("no-such-pool")
    with raises_code(ErrorCode.NOT_FOUND):
        client.restore("no-such-pool", 1, [])


@pytest.mark.parametrize(
    ("num_blocks", "block_size", "policy"),
    [(1, 4, "lru"), (0, 4, "lru"), (-5, 4, "lru"), (8, 0, "lru"), (8, -1, "lru"), (8, 4, "mru")],
)
def test_register_rejects_bad_pool_shapes(client, pool_id, num_blocks, block_size, policy):
    with raises_code(ErrorCode.INVALID_ARGUMENT):
        client.register(pool_id, PoolSpec(num_blocks, block_size, eviction_policy=policy))


def test_register_rejects_empty_pool_id(client):
    with raises_code(ErrorCode.INVALID_ARGUMENT, "pool_id"):
        client.register("", PoolSpec(8, BS))


# ---- ownership -------------------------------------------------------------------------------


def test_a_live_pool_is_refused_to_another_owner_and_its_sequences_are_untouchable(
    client, other_client, pool_id
):
    epoch = _register(client, pool_id)
    _admit(client, pool_id, epoch, 1, list(range(6)))
    with raises_code(ErrorCode.FAILED_PRECONDITION, "another owner"):
        other_client.register(pool_id, PoolSpec(16, BS))
    with raises_code(ErrorCode.FAILED_PRECONDITION, "owner_token"):
        other_client.step(pool_id, epoch, [Free((1,))])
    with raises_code(ErrorCode.FAILED_PRECONDITION, "owner_token"):
        other_client.restore(pool_id, epoch, [])
    with raises_code(ErrorCode.FAILED_PRECONDITION, "owner_token"):
        other_client.unregister(pool_id, epoch)
    # Nothing changed: the owner's sequence still holds its blocks and grows.
    assert _counters(client, pool_id).num_in_use_blocks == 2
    (grow,) = client.step(pool_id, epoch, [Grow((1,), (1,))]).results
    assert isinstance(grow, GrowResult) and grow.statuses == (OpStatus.OK,)


def test_a_new_pool_takes_a_proposed_owner_token_that_later_proves_ownership(
    client, other_client, pool_id
):
    secret = "s" * 32  # e.g. derived by an executor from its secret, the same after a restart
    first = client.register(pool_id, PoolSpec(16, BS), owner_token=secret)
    assert first.owner_token == secret
    with raises_code(ErrorCode.FAILED_PRECONDITION, "another owner"):
        other_client.register(pool_id, PoolSpec(16, BS))
    again = other_client.register(pool_id, PoolSpec(16, BS), owner_token=secret)  # the same owner
    assert again.epoch > first.epoch
    with raises_code(ErrorCode.INVALID_ARGUMENT, "owner_token"):
        client.register(pool_id + "-x", PoolSpec(16, BS), owner_token="short")


def test_the_owner_may_register_its_pool_again(client, pool_id):
    first = client.register(pool_id, PoolSpec(16, BS))
    again = client.register(pool_id, PoolSpec(16, BS))
    assert again.epoch > first.epoch


def test_unregister_reclaims_the_pool_and_frees_its_id(client, other_client, pool_id):
    epoch = _register(client, pool_id)
    _admit(client, pool_id, epoch, 1, list(range(6)))
    client.unregister(pool_id, epoch)
    with raises_code(ErrorCode.NOT_FOUND):
        client.stats(pool_id)
    fresh = other_client.register(pool_id, PoolSpec(8, BS))  # anyone may take the id now
    assert _counters(other_client, pool_id).num_in_use_blocks == 0
    other_client.unregister(pool_id, fresh.epoch)


def test_an_empty_step_is_a_lease_renewal_that_changes_nothing(client, pool_id):
    epoch = _register(client, pool_id)
    _admit(client, pool_id, epoch, 1, list(range(6)))
    result = client.step(pool_id, epoch, [])
    assert result.results == () and result.counters.num_in_use_blocks == 2


def test_a_step_sent_without_waiting_answers_as_a_plain_step_and_raises_at_result(client, pool_id):
    epoch = _register(client, pool_id)
    _admit(client, pool_id, epoch, 1, list(range(4)))
    call = client.step_async(pool_id, epoch, [Grow((1,), (1,))])
    (grow,) = call.result().results
    assert isinstance(grow, GrowResult) and grow.statuses == (OpStatus.OK,)
    assert len(grow.new_block_ids[0]) == 1  # the 5th token starts a block
    assert _counters(client, pool_id).num_in_use_blocks == 2
    bad = client.step_async(pool_id, epoch + 1, [Grow((1,), (1,))])
    with raises_code(ErrorCode.FAILED_PRECONDITION):
        bad.result()
    assert _counters(client, pool_id).num_in_use_blocks == 2


def test_a_step_naming_a_sequence_twice_in_one_grow_is_rejected_whole(client, pool_id):
    epoch = _register(client, pool_id)
    _admit(client, pool_id, epoch, 1, list(range(3)))
    before = _counters(client, pool_id)
    with raises_code(ErrorCode.INVALID_ARGUMENT, "listed twice"):
        client.step(pool_id, epoch, [Grow((1, 1), (2, 2))])
    assert _counters(client, pool_id) == before


def test_an_admission_repeating_a_block_hash_is_rejected(client, pool_id):
    epoch = _register(client, pool_id)
    h = hashes(list(range(4)), BS)[0]
    with raises_code(ErrorCode.INVALID_ARGUMENT, "listed twice"):
        client.step(pool_id, epoch, [Admit(1, 9, 9, (h, h))])
    assert _counters(client, pool_id).num_in_use_blocks == 0


# ---- allocation and growth ----------------------------------------------------------------


def test_admission_allocates_blocks_for_the_prompt_never_block_zero(client, pool_id):
    epoch = _register(client, pool_id)
    res = _admit(client, pool_id, epoch, 1, list(range(10)))
    assert res.status is OpStatus.OK
    assert len(res.block_ids) == 3 and 0 not in res.block_ids
    assert len(set(res.block_ids)) == 3
    assert (res.num_cached_tokens, res.num_tokens) == (0, 10)
    c = _counters(client, pool_id)
    assert (c.num_in_use_blocks, c.num_free_blocks, c.num_sequences) == (3, 12, 1)


def test_admission_budget_allocates_only_the_first_chunk(client, pool_id):
    epoch = _register(client, pool_id)
    res = _admit(client, pool_id, epoch, 1, list(range(10)), budget=5)
    assert (res.num_tokens, len(res.block_ids)) == (5, 2)
    g = _grow(client, pool_id, epoch, 1, 5)
    assert g.statuses == (OpStatus.OK,)
    assert len(g.new_block_ids[0]) == 1


def test_growth_allocates_only_when_the_last_block_is_full(client, pool_id):
    epoch = _register(client, pool_id)
    _admit(client, pool_id, epoch, 1, list(range(5)))  # 2 blocks, last holds 1 token
    for _ in range(3):
        assert _grow(client, pool_id, epoch, 1, 1).new_block_ids == ((),)
    g = _grow(client, pool_id, epoch, 1, 1)  # token 9 opens block 3
    assert len(g.new_block_ids[0]) == 1 and 0 not in g.new_block_ids[0]
    assert _counters(client, pool_id).num_in_use_blocks == 3


def test_free_returns_every_block(client, pool_id):
    epoch = _register(client, pool_id)
    _admit(client, pool_id, epoch, 1, list(range(10)))
    _admit(client, pool_id, epoch, 2, list(range(100, 103)))
    assert _free(client, pool_id, epoch, 1, 2).num_freed_blocks == 4
    c = _counters(client, pool_id)
    assert (c.num_free_blocks, c.num_in_use_blocks, c.num_sequences) == (15, 0, 0)


def test_double_free_is_failed_precondition_and_unknown_is_not_found(client, pool_id):
    epoch = _register(client, pool_id)
    _admit(client, pool_id, epoch, 1, list(range(3)))
    _free(client, pool_id, epoch, 1)
    with raises_code(ErrorCode.FAILED_PRECONDITION, "already freed"):
        _free(client, pool_id, epoch, 1)
    with raises_code(ErrorCode.NOT_FOUND, "unknown seq_id"):
        _free(client, pool_id, epoch, 999)
    with raises_code(ErrorCode.FAILED_PRECONDITION):
        client.step(pool_id, epoch, [Free((1,)), Free((1,))])


def test_duplicate_sequence_id_is_failed_precondition(client, pool_id):
    epoch = _register(client, pool_id)
    _admit(client, pool_id, epoch, 1, list(range(3)))
    with raises_code(ErrorCode.FAILED_PRECONDITION, "already exists"):
        _admit(client, pool_id, epoch, 1, list(range(3)))


def test_admission_that_does_not_fit_changes_nothing_and_skips_later_ops(client, pool_id):
    epoch = _register(client, pool_id, num_blocks=4)  # 3 usable
    _admit(client, pool_id, epoch, 1, list(range(4)))
    before = _counters(client, pool_id)
    res = client.step(
        pool_id,
        epoch,
        [
            Admit(2, 12, 100, hashes(list(range(12)), BS)),  # needs 3, 2 free
            Grow((2,), (1,)),
            Commit(2, 0, hashes(list(range(4)), BS)),
            Grow((1,), (4,)),
        ],
    ).results
    assert res[0] == AdmitResult(OpStatus.RESOURCE_EXHAUSTED)
    assert res[1].statuses == (OpStatus.SKIPPED,)
    assert res[2].status is OpStatus.SKIPPED
    assert res[3].statuses == (OpStatus.OK,)  # other sequences are unaffected
    after = _counters(client, pool_id)
    assert after.num_in_use_blocks == before.num_in_use_blocks + 1
    assert after.num_sequences == 1


def test_reserve_blocks_refuses_an_admission_that_would_drain_the_pool(client, pool_id):
    epoch = _register(client, pool_id, num_blocks=6)  # 5 usable
    assert _admit(client, pool_id, epoch, 1, list(range(12)), reserve=3).status is (
        OpStatus.RESOURCE_EXHAUSTED
    )
    assert _admit(client, pool_id, epoch, 1, list(range(12)), reserve=2).status is OpStatus.OK


def test_grow_entry_that_does_not_fit_fails_alone(client, pool_id):
    epoch = _register(client, pool_id, num_blocks=4)  # 3 usable
    _admit(client, pool_id, epoch, 1, list(range(4)))
    _admit(client, pool_id, epoch, 2, list(range(4)))
    (res,) = client.step(pool_id, epoch, [Grow((1, 2), (8, 1))]).results
    assert res.statuses == (OpStatus.RESOURCE_EXHAUSTED, OpStatus.OK)
    assert res.new_block_ids[0] == () and len(res.new_block_ids[1]) == 1


def test_free_releases_a_sequence_whose_grow_failed_in_the_same_step(client, pool_id):
    epoch = _register(client, pool_id, num_blocks=4)  # 3 usable
    _admit(client, pool_id, epoch, 1, list(range(4)))
    grow, free = client.step(pool_id, epoch, [Grow((1,), (40,)), Free((1,))]).results
    assert grow.statuses == (OpStatus.RESOURCE_EXHAUSTED,)
    assert free.num_freed_blocks == 1
    c = _counters(client, pool_id)
    assert (c.num_in_use_blocks, c.num_sequences) == (0, 0)


def test_invalid_op_rejects_the_whole_step_with_nothing_applied(client, pool_id):
    epoch = _register(client, pool_id)
    _admit(client, pool_id, epoch, 1, list(range(4)))
    before = _counters(client, pool_id)
    with raises_code(ErrorCode.INVALID_ARGUMENT, "ops[2]"):
        client.step(
            pool_id,
            epoch,
            [Grow((1,), (9,)), Admit(2, 5, 5), Grow((1,), (-1,))],
        )
    assert _counters(client, pool_id) == before
    # seq 2 was not admitted: admitting it now works
    assert _admit(client, pool_id, epoch, 2, list(range(5))).status is OpStatus.OK


@pytest.mark.parametrize(
    ("op", "field"),
    [
        (Admit(7, 0, 4), "num_prompt_tokens"),
        (Admit(7, 4, 0), "max_new_tokens"),
        (Admit(7, 4, 4, (), -1), "reserve_blocks"),
        (Admit(7, 8, 8, (b"short",)), "block_hashes"),
        (Admit(7, 5, 8, (bytes(32), bytes(32))), "block_hashes"),
        (Grow((1,), (-3,)), "num_tokens"),
        (Grow((1, 1), (1,)), "grow"),
        (Commit(1, -1, ()), "start_block"),
        (Commit(1, 0, (bytes(32), bytes(32))), "not all full"),
        (Commit(1, 0, (bytes(31),)), "block_hashes"),
    ],
)
def test_malformed_operations_are_invalid_argument_naming_the_field(client, pool_id, op, field):
    epoch = _register(client, pool_id)
    _admit(client, pool_id, epoch, 1, list(range(6)))
    before = _counters(client, pool_id)
    with raises_code(ErrorCode.INVALID_ARGUMENT, field):
        client.step(pool_id, epoch, [op])
    assert _counters(client, pool_id) == before


def test_operations_on_unknown_sequences_are_not_found(client, pool_id):
    epoch = _register(client, pool_id)
    for op in (Grow((5,), (1,)), Fork(5, 6), Commit(5, 0, ()), Free((5,))):
        with raises_code(ErrorCode.NOT_FOUND, "5"):
            client.step(pool_id, epoch, [op])


# ---- prefix caching --------------------------------------------------------------------------


def _commit_prompt(client, pool_id, epoch, seq_id, tokens, salt=b""):
    h = hashes(tokens, BS, salt)
    (res,) = client.step(pool_id, epoch, [Commit(seq_id, 0, h)]).results
    assert isinstance(res, CommitResult) and res.status is OpStatus.OK
    return res


def test_committed_blocks_are_reused_by_a_matching_prompt(client, pool_id):
    epoch = _register(client, pool_id)
    tokens = list(range(10))
    a = _admit(client, pool_id, epoch, 1, tokens)
    assert _commit_prompt(client, pool_id, epoch, 1, tokens).num_stored_blocks == 2
    b = _admit(client, pool_id, epoch, 2, [*tokens[:8], 77, 78, 79])
    assert b.num_cached_tokens == 8
    assert b.block_ids[:2] == a.block_ids[:2]
    assert b.block_ids[2] != a.block_ids[2]
    assert _counters(client, pool_id).num_in_use_blocks == 4
    s = client.stats(pool_id)
    assert (s.prefix_cache_queries_tokens, s.prefix_cache_hits_tokens) == (21, 8)


def test_uncommitted_blocks_are_not_matchable(client, pool_id):
    epoch = _register(client, pool_id)
    tokens = list(range(10))
    _admit(client, pool_id, epoch, 1, tokens)
    assert _admit(client, pool_id, epoch, 2, tokens).num_cached_tokens == 0


def test_a_hit_never_covers_the_last_prompt_token(client, pool_id):
    epoch = _register(client, pool_id)
    tokens = list(range(8))  # exactly two full blocks
    _admit(client, pool_id, epoch, 1, tokens)
    _commit_prompt(client, pool_id, epoch, 1, tokens)
    b = _admit(client, pool_id, epoch, 2, tokens)
    assert b.num_cached_tokens == 4  # the second block must be recomputed for its logits
    assert b.num_tokens == 8


def test_cache_salt_changes_the_chain_from_the_first_block(client, pool_id):
    epoch = _register(client, pool_id)
    tokens = list(range(10))
    _admit(client, pool_id, epoch, 1, tokens, salt=b"tenant-a")
    _commit_prompt(client, pool_id, epoch, 1, tokens, salt=b"tenant-a")
    assert _admit(client, pool_id, epoch, 2, tokens, salt=b"tenant-b").num_cached_tokens == 0
    assert _admit(client, pool_id, epoch, 3, tokens).num_cached_tokens == 0
    assert _admit(client, pool_id, epoch, 4, tokens, salt=b"tenant-a").num_cached_tokens == 8


def test_freed_cached_blocks_stay_matchable_and_a_hit_takes_them_back(client, pool_id):
    epoch = _register(client, pool_id)
    tokens = list(range(10))
    a = _admit(client, pool_id, epoch, 1, tokens)
    _commit_prompt(client, pool_id, epoch, 1, tokens)
    _free(client, pool_id, epoch, 1)
    c = _counters(client, pool_id)
    assert (c.num_free_blocks, c.num_cached_free_blocks) == (15, 2)
    b = _admit(client, pool_id, epoch, 2, tokens)
    assert b.num_cached_tokens == 8 and b.block_ids[:2] == a.block_ids[:2]
    c = _counters(client, pool_id)
    assert (c.num_free_blocks, c.num_cached_free_blocks, c.num_in_use_blocks) == (12, 0, 3)


def test_reuse_evicts_a_chains_tail_before_its_head(client, pool_id):
    epoch = _register(client, pool_id, num_blocks=5)  # 4 usable
    tokens = list(range(13))  # 4 blocks, 3 full
    _admit(client, pool_id, epoch, 1, tokens)
    _commit_prompt(client, pool_id, epoch, 1, tokens)
    _free(client, pool_id, epoch, 1)
    # 1 uncached free block + 3 cached; a 2-block admission must evict exactly one cached block
    _admit(client, pool_id, epoch, 2, list(range(100, 105)))
    _free(client, pool_id, epoch, 2)
    hit = _admit(client, pool_id, epoch, 3, tokens)
    assert hit.num_cached_tokens == 8  # the chain's head survived; its tail was evicted


def test_admission_fits_when_its_hits_are_in_the_free_queue(client, pool_id):
    epoch = _register(client, pool_id, num_blocks=4)  # 3 usable
    tokens = list(range(9))  # 3 blocks, 2 full
    _admit(client, pool_id, epoch, 1, tokens)
    _commit_prompt(client, pool_id, epoch, 1, tokens)
    _free(client, pool_id, epoch, 1)
    res = _admit(client, pool_id, epoch, 2, tokens)
    assert res.status is OpStatus.OK and res.num_cached_tokens == 8
    assert _counters(client, pool_id).num_free_blocks == 0


def test_prefix_caching_disabled_never_hits(client, pool_id):
    epoch = _register(client, pool_id, enable_prefix_caching=False)
    tokens = list(range(10))
    _admit(client, pool_id, epoch, 1, tokens)
    _commit_prompt(client, pool_id, epoch, 1, tokens)
    assert _admit(client, pool_id, epoch, 2, tokens).num_cached_tokens == 0


# ---- fork and copy-on-write ------------------------------------------------------------------


def test_fork_shares_every_block_including_the_partial_last(client, pool_id):
    epoch = _register(client, pool_id)
    _admit(client, pool_id, epoch, 1, list(range(6)))
    before = _counters(client, pool_id)
    (res,) = client.step(pool_id, epoch, [Fork(1, 2)]).results
    assert res == ForkResult(OpStatus.OK, 2)
    after = _counters(client, pool_id)
    assert after.num_in_use_blocks == before.num_in_use_blocks
    assert after.num_sequences == 2


def test_growing_into_a_shared_partial_block_copies_it_first(client, pool_id):
    epoch = _register(client, pool_id)
    a = _admit(client, pool_id, epoch, 1, list(range(6)))
    client.step(pool_id, epoch, [Fork(1, 2), Fork(1, 3)])
    g = _grow(client, pool_id, epoch, 2, 1)
    (copy,) = g.copies
    assert (copy.entry, copy.block_index, copy.src) == (0, 1, a.block_ids[1])
    assert copy.dst not in a.block_ids and copy.dst != 0
    # The last sharer writes in place once nobody else holds the block.
    assert len(_grow(client, pool_id, epoch, 3, 1).copies) == 1
    assert _grow(client, pool_id, epoch, 1, 1).copies == ()
    s = client.stats(pool_id)
    assert s.num_cow_copies == 2
    assert s.counters.num_in_use_blocks == 4


def test_growing_past_a_shared_full_block_needs_no_copy(client, pool_id):
    epoch = _register(client, pool_id)
    _admit(client, pool_id, epoch, 1, list(range(8)))
    client.step(pool_id, epoch, [Fork(1, 2)])
    g = _grow(client, pool_id, epoch, 2, 1)
    assert g.copies == () and len(g.new_block_ids[0]) == 1


def test_fork_errors(client, pool_id):
    epoch = _register(client, pool_id)
    _admit(client, pool_id, epoch, 1, list(range(6)))
    _admit(client, pool_id, epoch, 2, list(range(6)))
    with raises_code(ErrorCode.FAILED_PRECONDITION, "already exists"):
        client.step(pool_id, epoch, [Fork(1, 2)])
    with raises_code(ErrorCode.FAILED_PRECONDITION, "already exists"):
        client.step(pool_id, epoch, [Fork(1, 1)])


def test_freeing_forked_sequences_releases_shared_blocks_once(client, pool_id):
    epoch = _register(client, pool_id)
    _admit(client, pool_id, epoch, 1, list(range(6)))
    client.step(pool_id, epoch, [Fork(1, 2), Grow((2,), (3,))])
    assert _free(client, pool_id, epoch, 1).num_freed_blocks == 1  # its private last block
    assert _free(client, pool_id, epoch, 2).num_freed_blocks == 3  # shared head, copy, new
    assert _counters(client, pool_id).num_in_use_blocks == 0


# ---- recovery --------------------------------------------------------------------------------


def test_restore_rebuilds_live_tables_after_reregistration(client, pool_id):
    epoch = _register(client, pool_id)
    tokens = list(range(10))
    a = _admit(client, pool_id, epoch, 1, tokens)
    client.step(pool_id, epoch, [Fork(1, 2)])
    epoch = _register(client, pool_id)  # as after a block-manager restart
    table = a.block_ids
    res = client.restore(
        pool_id,
        epoch,
        [
            RestoredSequence(1, 10, table, hashes(tokens, BS)),
            RestoredSequence(2, 10, table),
        ],
    )
    assert (res.num_sequences, res.num_stored_blocks) == (2, 2)
    assert (res.counters.num_in_use_blocks, res.counters.num_sequences) == (3, 2)
    # Shared partial block: the first writer gets a copy, the restored refcounts are right.
    g = _grow(client, pool_id, epoch, 2, 1)
    assert len(g.copies) == 1 and g.copies[0].src == table[2]
    assert _grow(client, pool_id, epoch, 1, 1).copies == ()
    # Restored hashes are matchable again.
    assert _admit(client, pool_id, epoch, 3, tokens).num_cached_tokens == 8
    _free(client, pool_id, epoch, 1, 2, 3)
    assert _counters(client, pool_id).num_in_use_blocks == 0


@pytest.mark.parametrize(
    ("seq", "field"),
    [
        (RestoredSequence(1, 5, (1, 0)), "reserved"),
        (RestoredSequence(1, 5, (1, 99)), "out of range"),
        (RestoredSequence(1, 5, (1, -2)), "out of range"),
        (RestoredSequence(1, 5, (1,)), "need 2 blocks"),
        (RestoredSequence(1, 5, (3, 3)), "twice"),
        (RestoredSequence(1, -1, ()), "num_tokens"),
        (RestoredSequence(1, 5, (1, 2), (bytes(32), bytes(32))), "block_hashes"),
    ],
)
def test_restore_rejects_bad_tables(client, pool_id, seq, field):
    epoch = _register(client, pool_id)
    with raises_code(ErrorCode.INVALID_ARGUMENT, field):
        client.restore(pool_id, epoch, [seq])
    assert _counters(client, pool_id).num_in_use_blocks == 0


def test_restore_into_a_pool_with_live_sequences_is_refused(client, pool_id):
    epoch = _register(client, pool_id)
    _admit(client, pool_id, epoch, 1, list(range(3)))
    with raises_code(ErrorCode.FAILED_PRECONDITION):
        client.restore(pool_id, epoch, [RestoredSequence(2, 3, (5,))])
    with raises_code(ErrorCode.FAILED_PRECONDITION, "stale epoch"):
        client.restore(pool_id, epoch - 1, [])


def test_restore_with_duplicate_sequence_ids_is_refused(client, pool_id):
    epoch = _register(client, pool_id)
    with raises_code(ErrorCode.FAILED_PRECONDITION, "twice"):
        client.restore(pool_id, epoch, [RestoredSequence(1, 1, (1,)), RestoredSequence(1, 1, (2,))])


# ---- events ----------------------------------------------------------------------------------


def _collect(stream, n_events: int, timeout: float = 5.0):
    """Read batches on a thread until n_events arrived (or time out)."""
    return collect_events(stream, until=lambda got: len(got) >= n_events, timeout=timeout)


def test_event_stream_reports_stored_removed_and_cleared_in_order(client, pool_id):
    epoch = _register(client, pool_id, num_blocks=4)  # 3 usable
    tokens = list(range(8))
    _admit(client, pool_id, epoch, 1, tokens)
    h = hashes(tokens, BS)
    client.step(pool_id, epoch, [Commit(1, 0, h), Free((1,))])
    _admit(client, pool_id, epoch, 2, list(range(50, 62)))  # evicts both cached blocks
    new_epoch = _register(client, pool_id, num_blocks=4)
    events = _collect(client.events(pool_id), 4)
    kinds = [e.kind for e in events]
    # Every epoch opens with CLEARED, the first registration's too.
    assert kinds == [
        KVEventKind.CLEARED,
        KVEventKind.STORED,
        KVEventKind.REMOVED,
        KVEventKind.CLEARED,
    ]
    assert events[1].block_hashes == h
    assert set(events[2].block_hashes) == set(h)
    assert (events[0].epoch, events[3].epoch) == (epoch, new_epoch)
    seqs = [e.seq for e in events]
    assert seqs == sorted(seqs) and len(set(seqs)) == 4


def test_event_stream_replays_after_a_sequence_number_then_goes_live(client, pool_id):
    epoch = _register(client, pool_id)
    t1, t2 = list(range(4)), list(range(10, 14))
    _admit(client, pool_id, epoch, 1, [*t1, 99])
    client.step(pool_id, epoch, [Commit(1, 0, hashes(t1, BS))])
    first = client.stats(pool_id).last_event_seq
    stream = client.events(pool_id, start_after_seq=first)
    _admit(client, pool_id, epoch, 2, [*t2, 99])
    client.step(pool_id, epoch, [Commit(2, 0, hashes(t2, BS))])
    (event,) = _collect(stream, 1)
    assert event.seq == first + 1 and event.block_hashes == hashes(t2, BS)


def test_event_stream_of_unknown_pool_is_not_found(client):
    stream = client.events("no-such-pool")
    with raises_code(ErrorCode.NOT_FOUND):
        for _ in stream:
            pass
