"""The contract's preemption by swapping (``SwapOutOp`` / ``SwapInOp``): a sequence's blocks go
to host slots held for it and come back into a table of the same length, all or nothing per
entry, with clear errors for every other use of a swapped-out id. Skipped against an
implementation that registers no host tier."""

from __future__ import annotations

import pytest

from services.blockmgr.api.errors import ErrorCode
from services.blockmgr.api.protocol import BlockManagerClient
from services.blockmgr.api.types import (
    Admit,
    AdmitResult,
    Commit,
    Fork,
    Free,
    Grow,
    GrowResult,
    OpStatus,
    PoolSpec,
    RestoredSequence,
    StepResult,
    SwapIn,
    SwapInResult,
    SwapOut,
    SwapOutResult,
)
from tests.blockmgr.conformance.ops import BS
from tests.blockmgr.helpers import hashes, raises_code

PROMPT = list(range(100, 114))  # 3 full blocks and 2 tokens: 4 blocks


def _register(client: BlockManagerClient, pool_id: str, num_blocks: int, host: int) -> int:
    info = client.register(pool_id, PoolSpec(num_blocks, BS, host_blocks=host))
    if info.host_blocks != host:
        pytest.skip("this implementation serves no host tier")
    return info.epoch


def _admit(client, pool_id, epoch, seq_id, tokens=PROMPT) -> AdmitResult:
    (res,) = client.step(
        pool_id, epoch, [Admit(seq_id, len(tokens), len(tokens), hashes(tokens, BS))]
    ).results
    assert isinstance(res, AdmitResult) and res.status is OpStatus.OK
    return res


def _swap_out(client, pool_id, epoch, *seq_ids) -> tuple[SwapOutResult, StepResult]:
    step = client.step(pool_id, epoch, [SwapOut(seq_ids)])
    (res,) = step.results
    assert isinstance(res, SwapOutResult)
    return res, step


def _swap_in(client, pool_id, epoch, *seq_ids) -> tuple[SwapInResult, StepResult]:
    step = client.step(pool_id, epoch, [SwapIn(seq_ids)])
    (res,) = step.results
    assert isinstance(res, SwapInResult)
    return res, step


def test_a_swapped_out_sequence_frees_its_device_blocks_and_comes_back_from_its_slots(
    client, pool_id
):
    epoch = _register(client, pool_id, 9, 8)
    table = _admit(client, pool_id, epoch, 1).block_ids
    out, step = _swap_out(client, pool_id, epoch, 1)
    assert out.statuses == (OpStatus.OK,) and out.num_freed_blocks == 4
    (slots,) = out.host_slots
    assert len(set(slots)) == 4 and all(0 <= s < 8 for s in slots)
    assert [(m.device_block, m.host_slot) for m in step.offloads] == list(
        zip(table, slots, strict=True)
    )
    assert step.counters.num_in_use_blocks == 0
    stats = client.stats(pool_id)
    assert (stats.num_swapped_sequences, stats.num_swapped_out_blocks) == (1, 4)
    # Another sequence takes the device blocks meanwhile.
    _admit(client, pool_id, epoch, 2, list(range(500, 532)))
    client.step(pool_id, epoch, [Free((2,))])
    back, step = _swap_in(client, pool_id, epoch, 1)
    assert back.statuses == (OpStatus.OK,)
    (new_table,) = back.block_ids
    assert len(new_table) == 4
    assert sorted((m.host_slot, m.device_block) for m in step.onboards) == sorted(
        zip(slots, new_table, strict=True)
    )
    # Its 14 token slots came back: it grows on from there (2 more fit the last block).
    (g,) = client.step(pool_id, epoch, [Grow((1,), (2,))]).results
    assert isinstance(g, GrowResult) and g.new_block_ids == ((),)
    stats = client.stats(pool_id)
    assert (stats.num_swapped_sequences, stats.num_swapped_in_blocks) == (0, 4)


def test_swap_in_shares_blocks_still_cached_on_the_device_instead_of_copying(client, pool_id):
    epoch = _register(client, pool_id, 16, 8)
    table = _admit(client, pool_id, epoch, 1).block_ids
    client.step(pool_id, epoch, [Commit(1, 0, hashes(PROMPT, BS))])
    out, _ = _swap_out(client, pool_id, epoch, 1)
    back, step = _swap_in(client, pool_id, epoch, 1)
    (new_table,) = back.block_ids
    # The 3 committed blocks were still cached: shared again; only the partial one is copied.
    assert new_table[:3] == table[:3]
    assert [(m.host_slot, m.device_block) for m in step.onboards] == [
        (out.host_slots[0][3], new_table[3])
    ]


def test_a_swapped_out_id_takes_only_swap_in_or_free(client, pool_id):
    epoch = _register(client, pool_id, 9, 8)
    _admit(client, pool_id, epoch, 1)
    _swap_out(client, pool_id, epoch, 1)
    for op, where in [
        (Grow((1,), (1,)), "ops[0].grow.seq_ids[0]"),
        (Commit(1, 0, hashes(PROMPT, BS)[:1]), "ops[0].commit.seq_id"),
        (Fork(1, 2), "ops[0].fork.parent_seq_id"),
        (SwapOut((1,)), "ops[0].swap_out.seq_ids[0]"),
        (Admit(1, 4, 4), "ops[0].admit.seq_id"),
    ]:
        with raises_code(ErrorCode.FAILED_PRECONDITION, where):
            client.step(pool_id, epoch, [op])
    _admit(client, pool_id, epoch, 3)
    with raises_code(ErrorCode.FAILED_PRECONDITION, "is not swapped out"):
        client.step(pool_id, epoch, [SwapIn((3,))])
    with raises_code(ErrorCode.NOT_FOUND, "ops[0].swap_in.seq_ids[0]"):
        client.step(pool_id, epoch, [SwapIn((99,))])
    with raises_code(ErrorCode.INVALID_ARGUMENT, "listed twice"):
        client.step(pool_id, epoch, [SwapOut((3, 3))])
    # Free gives its slots back (they are free from the next Step); a second Free is refused.
    client.step(pool_id, epoch, [Free((1,))])
    assert client.stats(pool_id).num_swapped_sequences == 0
    with raises_code(ErrorCode.FAILED_PRECONDITION, "already freed"):
        client.step(pool_id, epoch, [Free((1,))])
    out, _ = _swap_out(client, pool_id, epoch, 3)
    assert out.statuses == (OpStatus.OK,)


def test_swapping_needs_a_host_tier_and_a_sequence_untouched_in_the_step(client, pool_id):
    info = client.register(pool_id, PoolSpec(9, BS))
    _admit(client, pool_id, info.epoch, 1)
    with raises_code(ErrorCode.FAILED_PRECONDITION, "ops[0].swap_out: the pool has no host tier"):
        client.step(pool_id, info.epoch, [SwapOut((1,))])
    epoch = _register(client, pool_id, 9, 8)
    _admit(client, pool_id, epoch, 1)
    with raises_code(ErrorCode.FAILED_PRECONDITION, "ops[1].swap_out.seq_ids[0]"):
        client.step(pool_id, epoch, [Grow((1,), (4,)), SwapOut((1,))])
    with raises_code(ErrorCode.FAILED_PRECONDITION, "in a Step of its own"):
        client.step(pool_id, epoch, [Admit(2, 4, 4), SwapOut((2,))])
    assert client.stats(pool_id).counters.num_sequences == 1  # nothing applied


def test_a_swap_out_the_tier_cannot_hold_is_refused_whole_and_changes_nothing(client, pool_id):
    epoch = _register(client, pool_id, 12, 6)
    first = _admit(client, pool_id, epoch, 1).block_ids
    _admit(client, pool_id, epoch, 2)
    out, step = _swap_out(client, pool_id, epoch, 1, 2)  # 4 + 4 blocks, 6 slots
    assert out.statuses == (OpStatus.OK, OpStatus.RESOURCE_EXHAUSTED)
    assert out.host_slots[1] == () and len(step.offloads) == 4
    (g,) = client.step(pool_id, epoch, [Grow((2,), (1,))]).results  # still live
    assert isinstance(g, GrowResult) and g.statuses == (OpStatus.OK,)
    # The device is full now: swapping 1 back in must wait, and stays swapped out.
    _admit(client, pool_id, epoch, 3, list(range(700, 727)))
    back, _ = _swap_in(client, pool_id, epoch, 1)
    assert back.statuses == (OpStatus.RESOURCE_EXHAUSTED,) and back.block_ids == ((),)
    client.step(pool_id, epoch, [Free((3,))])
    back, _ = _swap_in(client, pool_id, epoch, 1)
    assert back.statuses == (OpStatus.OK,) and len(back.block_ids[0]) == len(first)


def test_swapped_out_slots_are_never_taken_by_offloads_of_evicted_blocks(client, pool_id):
    epoch = _register(client, pool_id, 6, 6)  # 5 usable device blocks, 6 slots
    _admit(client, pool_id, epoch, 1)
    out, _ = _swap_out(client, pool_id, epoch, 1)
    (slots,) = out.host_slots
    # Churn: many cached blocks evicted from the device, each offloaded to the 2 other slots.
    for i in range(6):
        tokens = list(range(1000 + 20 * i, 1016 + 20 * i))
        _admit(client, pool_id, epoch, 10 + i, tokens)
        step = client.step(pool_id, epoch, [Commit(10 + i, 0, hashes(tokens, BS)), Free((10 + i,))])
        assert not set(slots) & {m.host_slot for m in step.offloads}
    back, step = _swap_in(client, pool_id, epoch, 1)
    assert back.statuses == (OpStatus.OK,)
    assert sorted(m.host_slot for m in step.onboards) == sorted(slots)


def test_sequences_swapped_together_share_slots_and_come_back_sharing_blocks(client, pool_id):
    epoch = _register(client, pool_id, 16, 8)
    parent = _admit(client, pool_id, epoch, 1).block_ids
    client.step(pool_id, epoch, [Fork(1, 2)])
    out, step = _swap_out(client, pool_id, epoch, 1, 2)
    assert out.host_slots[0] == out.host_slots[1] and len(step.offloads) == len(parent)
    assert out.num_freed_blocks == len(parent)
    back, step = _swap_in(client, pool_id, epoch, 1, 2)
    assert back.block_ids[0] == back.block_ids[1] and len(step.onboards) == len(parent)
    # Shared: the next write into the partial last block copies it first.
    (g,) = client.step(pool_id, epoch, [Grow((2,), (1,))]).results
    assert isinstance(g, GrowResult) and len(g.copies) == 1


def test_restore_rebuilds_swapped_out_sequences_from_their_slots(client, pool_id):
    epoch = _register(client, pool_id, 9, 8)
    _admit(client, pool_id, epoch, 1)
    out, _ = _swap_out(client, pool_id, epoch, 1)
    (slots,) = out.host_slots
    epoch = _register(client, pool_id, 9, 8)  # a new epoch: an empty pool, as after a restart
    with raises_code(ErrorCode.INVALID_ARGUMENT, "sequences[0].host_slots"):
        client.restore(pool_id, epoch, [RestoredSequence(1, 14, (), (), slots[:3])])
    with raises_code(ErrorCode.INVALID_ARGUMENT, "sequences[0]: a swapped-out sequence"):
        client.restore(pool_id, epoch, [RestoredSequence(1, 14, (1, 2, 3, 4), (), slots)])
    client.restore(pool_id, epoch, [RestoredSequence(1, 14, (), (), slots)])
    assert client.stats(pool_id).num_swapped_sequences == 1
    back, step = _swap_in(client, pool_id, epoch, 1)
    assert back.statuses == (OpStatus.OK,)
    assert sorted(m.host_slot for m in step.onboards) == sorted(slots)


def test_slots_freed_with_a_swapped_out_sequence_serve_a_swap_out_of_the_same_step(client, pool_id):
    epoch = _register(client, pool_id, 12, 4)  # 4 slots: one sequence's table
    _admit(client, pool_id, epoch, 1)
    _admit(client, pool_id, epoch, 2, list(range(300, 314)))
    _swap_out(client, pool_id, epoch, 1)
    step = client.step(pool_id, epoch, [Free((1,)), SwapOut((2,))])
    out = step.results[1]
    assert isinstance(out, SwapOutResult) and out.statuses == (OpStatus.OK,)
    assert len(step.offloads) == 4


def test_a_swapped_in_block_freed_and_refilled_in_one_step_is_filled_once(client, pool_id):
    """[SwapIn (fills B from its slot), Free, Admit (a host hit fills B again)] in one Step:
    the swap-in's fill of B is cancelled, so B is written once, with the hit's block."""
    epoch = _register(client, pool_id, 4, 4)  # 3 usable device blocks
    _admit(client, pool_id, epoch, 1, [7, 8, 9])  # one partial block
    _swap_out(client, pool_id, epoch, 1)
    prompt = list(range(200, 204))
    _admit(client, pool_id, epoch, 2, prompt)
    client.step(pool_id, epoch, [Commit(2, 0, hashes(prompt, BS)), Free((2,))])
    other = list(range(300, 312))
    _admit(client, pool_id, epoch, 3, other)  # evicts it to the host
    # Cached free: the block the swap-in frees will be the only uncached one, taken first.
    client.step(pool_id, epoch, [Commit(3, 0, hashes(other, BS)), Free((3,))])
    step = client.step(
        pool_id,
        epoch,
        [SwapIn((1,)), Free((1,)), Admit(4, 5, 5, hashes([*prompt, 1], BS))],
    )
    back, _, hit = step.results
    assert back.statuses == (OpStatus.OK,) and hit.num_cached_tokens == 4
    filled = [m.device_block for m in step.onboards]
    assert len(filled) == len(set(filled))
    assert hit.block_ids[0] in filled
