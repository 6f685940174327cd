"""The contract's lookahead slots (speculative decoding, ``GrowOp.num_lookahead``): a sequence
holds slots beyond its verified tokens for its drafts; only verified tokens' blocks commit, a
sliding window releases by verified tokens, rejected slots are kept (never freed by a grow),
forks share only verified blocks, and swap and restore carry the surplus."""

from __future__ import annotations

import pytest

from services.blockmgr.api.errors import ErrorCode
from services.blockmgr.api.protocol import BlockManagerClient
from services.blockmgr.api.types import (
    AttentionKindName,
    Commit,
    Fork,
    Grow,
    GrowResult,
    KVCacheGroup,
    OpStatus,
    PoolSpec,
    RestoredSequence,
    SwapIn,
    SwapInResult,
    SwapOut,
    SwapOutResult,
)
from tests.blockmgr.conformance.ops import BS, admit, in_use, step1
from tests.blockmgr.helpers import hashes, raises_code

PROMPT = list(range(100, 106))  # 6 tokens: 2 blocks of 4, the last half full


def _register(client: BlockManagerClient, pool_id: str, num_blocks: int = 16, **kw) -> int:
    return client.register(pool_id, PoolSpec(num_blocks, BS, **kw)).epoch


def _grow(client, pool_id, epoch, seq_id: int, n: int, lookahead: int) -> GrowResult:
    res = step1(client, pool_id, epoch, Grow((seq_id,), (n,), (lookahead,)))
    assert isinstance(res, GrowResult)
    return res


def test_lookahead_slots_are_allocated_beyond_the_verified_tokens(client, pool_id):
    epoch = _register(client, pool_id)
    admit(client, pool_id, epoch, 1, PROMPT)  # 6 slots, 2 blocks
    res = _grow(client, pool_id, epoch, 1, 1, 5)  # 7 tokens + 5 drafts: 12 slots, 3 blocks
    assert res.statuses == (OpStatus.OK,) and len(res.new_block_ids[0]) == 1
    assert in_use(client, pool_id) == 3


def test_rejected_drafts_keep_their_slots_and_the_next_grow_reuses_them(client, pool_id):
    epoch = _register(client, pool_id)
    admit(client, pool_id, epoch, 1, PROMPT)
    _grow(client, pool_id, epoch, 1, 1, 5)  # slots for tokens 7..12
    # All drafts rejected: one more verified token, drafts again. 8 + 4 = 12: no new block.
    res = _grow(client, pool_id, epoch, 1, 1, 4)
    assert res.new_block_ids == ((),) and in_use(client, pool_id) == 3
    # No speculation this step: the slots stay (a grow never gives slots back).
    res = _grow(client, pool_id, epoch, 1, 1, 0)
    assert res.new_block_ids == ((),) and in_use(client, pool_id) == 3
    # Past the slots held: a new block.
    res = _grow(client, pool_id, epoch, 1, 3, 2)  # 12 tokens + 2: 14 slots, 4 blocks
    assert len(res.new_block_ids[0]) == 1 and in_use(client, pool_id) == 4


def test_only_blocks_of_verified_tokens_commit(client, pool_id):
    epoch = _register(client, pool_id)
    tokens = [*PROMPT, 106]
    admit(client, pool_id, epoch, 1, PROMPT)
    _grow(client, pool_id, epoch, 1, 1, 5)  # 7 verified tokens, 12 slots
    block_hashes = hashes([*tokens, 107, 108, 109, 110, 111], BS)
    with raises_code(ErrorCode.INVALID_ARGUMENT, "not all full"):
        client.step(pool_id, epoch, [Commit(1, 0, block_hashes[:2])])  # block 1: 3 verified
    client.step(pool_id, epoch, [Commit(1, 0, block_hashes[:1])])
    _grow(client, pool_id, epoch, 1, 5, 0)  # drafts accepted: 12 verified tokens
    client.step(pool_id, epoch, [Commit(1, 1, block_hashes[1:3])])


def test_a_grow_with_the_wrong_number_of_lookaheads_is_refused_naming_the_field(client, pool_id):
    epoch = _register(client, pool_id)
    admit(client, pool_id, epoch, 1, PROMPT)
    admit(client, pool_id, epoch, 2, list(range(200, 206)))
    with raises_code(ErrorCode.INVALID_ARGUMENT, "grow.num_lookahead"):
        client.step(pool_id, epoch, [Grow((1, 2), (1, 1), (3,))])
    with raises_code(ErrorCode.INVALID_ARGUMENT, "grow.num_lookahead[1] must be >= 0"):
        client.step(pool_id, epoch, [Grow((1, 2), (1, 1), (3, -1))])
    assert in_use(client, pool_id) == 4  # nothing applied


def test_a_sliding_window_releases_by_verified_tokens_only(client, pool_id):
    # Window 4: a query at position p reads (p - 4, p]. 16 verified tokens then a grow of 1:
    # the query at 16 reads 13..16, so blocks 0..2 (tokens 0..11) are released; lookahead
    # slots 17..24 release nothing more.
    group = KVCacheGroup(AttentionKindName.SLIDING, 4, (0,))
    info = client.register(pool_id, PoolSpec(32, BS, groups=(group,)))
    if not info.groups or info.groups[0].sliding_window != 4:
        pytest.skip("this implementation serves no sliding-window pools")
    epoch = info.epoch
    admit(client, pool_id, epoch, 1, list(range(100, 116)))  # 16 tokens: 4 blocks
    with_lookahead = _grow(client, pool_id, epoch, 1, 1, 8)
    assert with_lookahead.first_live_blocks == (3,)
    # 17 verified + 8 slots = 25 slots: blocks 3..6 held (0..2 released).
    assert in_use(client, pool_id) == 4


def test_a_fork_shares_only_the_blocks_of_verified_tokens(client, pool_id):
    epoch = _register(client, pool_id)
    admit(client, pool_id, epoch, 1, PROMPT)
    _grow(client, pool_id, epoch, 1, 1, 5)  # 7 tokens (2 blocks), 12 slots (3 blocks)
    before = in_use(client, pool_id)
    fork = step1(client, pool_id, epoch, Fork(1, 2))
    assert fork.status is OpStatus.OK and fork.num_shared_blocks == 2
    # The child writes its 8th token into the shared, partly filled block 1: a private copy,
    # and its own block for its lookahead.
    res = _grow(client, pool_id, epoch, 2, 1, 4)  # 8 tokens + 4: 3 blocks
    assert [c.block_index for c in res.copies] == [1]
    assert len(res.new_block_ids[0]) == 1
    assert in_use(client, pool_id) == before + 2


def test_a_grow_into_a_shared_block_behind_the_lookahead_copies_that_block(client, pool_id):
    epoch = _register(client, pool_id)
    admit(client, pool_id, epoch, 1, PROMPT)
    _grow(client, pool_id, epoch, 1, 1, 5)  # 7 tokens, 12 slots: block 1 partly verified
    step1(client, pool_id, epoch, Fork(1, 2))  # block 1 shared now
    res = _grow(client, pool_id, epoch, 1, 1, 4)  # the parent's 8th token lands in block 1
    assert [(c.block_index, c.group) for c in res.copies] == [(1, 0)]
    assert res.new_block_ids == ((),)  # its lookahead block 2 is its own already


def test_swap_and_restore_carry_the_lookahead_slots(client, pool_id):
    info = client.register(pool_id, PoolSpec(16, BS, host_blocks=8))
    if info.host_blocks != 8:
        pytest.skip("this implementation serves no host tier")
    epoch = info.epoch
    admit(client, pool_id, epoch, 1, PROMPT)
    _grow(client, pool_id, epoch, 1, 1, 5)  # 7 tokens, 12 slots: 3 blocks
    out = step1(client, pool_id, epoch, SwapOut((1,)))
    assert isinstance(out, SwapOutResult) and len(out.host_slots[0]) == 3
    back = step1(client, pool_id, epoch, SwapIn((1,)))
    assert isinstance(back, SwapInResult) and len(back.block_ids[0]) == 3
    # Its slots came back: 8 tokens + 4 drafts fit without a new block.
    assert _grow(client, pool_id, epoch, 1, 1, 4).new_block_ids == ((),)
    table = back.block_ids[0]
    # After a restart, the executor restores it with its surplus.
    epoch = client.register(pool_id, PoolSpec(16, BS, host_blocks=8)).epoch
    with raises_code(ErrorCode.INVALID_ARGUMENT, "sequences[0].block_ids"):
        client.restore(pool_id, epoch, [RestoredSequence(1, 8, table)])  # 8 slots: 2 blocks
    client.restore(pool_id, epoch, [RestoredSequence(1, 8, table, num_lookahead=4)])
    assert _grow(client, pool_id, epoch, 1, 1, 3).new_block_ids == ((),)
    assert in_use(client, pool_id) == 3
