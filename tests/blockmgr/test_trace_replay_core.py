"""Traces at the core: a replay as recorded matches the live pool even when empty Steps (the
pool's clock) drive retention priorities out, a tier override skips the pools that cannot
have one, and a pool's prefix hit margin is replayed."""

from __future__ import annotations

from services.blockmgr.api.types import (
    Admit,
    AttentionKindName,
    Commit,
    Free,
    Grow,
    KVCacheGroup,
    PoolSpec,
    RestoredSequence,
    SwapIn,
    SwapOut,
)
from services.blockmgr.client import InProcessClient
from services.blockmgr.service.core import BlockManagerCore
from services.blockmgr.trace.record import (
    RegisterRecord,
    RestoreRecord,
    StepRecord,
    TraceWriter,
    read_trace,
)
from services.blockmgr.trace.replay import replay
from tests.blockmgr.helpers import hashes

BS = 4


def _turn(core, epoch, seq_id, tokens, priority=0):
    h = hashes(tokens, BS)
    core.step("p", epoch, [Admit(seq_id, len(tokens), len(tokens), h, 0, priority)])
    core.step("p", epoch, [Commit(seq_id, 0, h), Free((seq_id,))])


def test_a_replay_counts_empty_steps_as_the_pools_clock(tmp_path):
    trace = TraceWriter(tmp_path / "t.jsonl")
    core = InProcessClient(BlockManagerCore(trace=trace, retention_steps=6))
    epoch = core.register("p", PoolSpec(9, BS)).epoch  # 8 usable
    _turn(core, epoch, 1, list(range(16)), priority=3)  # retained: 4 blocks
    for _ in range(5):  # keepalives: the retention runs out
        core.step("p", epoch, [])
    for j in range(4):
        _turn(core, epoch, 10 + j, list(range(100 * (j + 1), 100 * (j + 1) + 8)))
    _turn(core, epoch, 20, list(range(16)))
    live = core.stats("p")
    trace.close()
    again = replay(list(read_trace(tmp_path / "t.jsonl")))
    assert (again.hits_tokens, again.num_evicted_blocks) == (
        live.prefix_cache_hits_tokens,
        live.num_evicted_blocks,
    )


def test_a_host_tier_override_leaves_sliding_pools_without_one(tmp_path):
    trace = TraceWriter(tmp_path / "t.jsonl")
    core = InProcessClient(BlockManagerCore(trace=trace))
    sliding = KVCacheGroup(AttentionKindName.SLIDING, 8)
    epoch = core.register("p", PoolSpec(9, BS, groups=tuple([sliding]))).epoch
    _turn(core, epoch, 1, list(range(16)))
    trace.close()
    result = replay(list(read_trace(tmp_path / "t.jsonl")), host_blocks=4)
    assert result.num_offloaded_blocks == 0 and result.queries_tokens == 16


def test_swaps_and_swapped_restores_are_recorded_and_replayed_as_live(tmp_path):
    trace = TraceWriter(tmp_path / "t.jsonl")
    core = InProcessClient(BlockManagerCore(trace=trace))
    epoch = core.register("p", PoolSpec(9, BS, host_blocks=8)).epoch
    tokens = list(range(14))
    h = hashes(tokens, BS)
    core.step("p", epoch, [Admit(1, 14, 14, h), Commit(1, 0, h)])
    out = core.step("p", epoch, [SwapOut((1,))]).results[0]
    epoch = core.register(
        "p", PoolSpec(9, BS, host_blocks=8)
    ).epoch  # restarted: restored from slots
    core.restore("p", epoch, [RestoredSequence(1, 14, (), h, out.host_slots[0])])
    core.step("p", epoch, [SwapIn((1,)), Grow((1,), (2,))])
    core.step("p", epoch, [SwapOut((1,))])
    core.step("p", epoch, [Free((1,))])
    live = core.stats("p")
    trace.close()
    records = list(read_trace(tmp_path / "t.jsonl"))
    assert any(isinstance(r, RestoreRecord) and r.sequences[0].host_slots for r in records)
    again = replay(records)
    assert again.num_dropped == 0
    # Both epochs: 4 blocks out, restored, 4 in, 4 out again (the live stats: this epoch's).
    assert (again.num_swapped_out_blocks, again.num_swapped_in_blocks) == (8, 4)
    assert (live.num_swapped_out_blocks, live.num_swapped_in_blocks) == (4, 4)
    # Without a host tier, a swap-out is replayed as a Free (the sequence recomputed): its
    # later operations are skipped, not refused.
    assert replay(records, host_blocks=0).num_ops < sum(
        len(r.ops) for r in records if isinstance(r, StepRecord)
    )


def test_a_prefix_hit_margin_is_recorded_and_replayed(tmp_path):
    trace = TraceWriter(tmp_path / "t.jsonl")
    core = InProcessClient(BlockManagerCore(trace=trace))
    epoch = core.register("p", PoolSpec(9, BS, prefix_hit_margin=1)).epoch
    _turn(core, epoch, 1, list(range(16)))
    _turn(core, epoch, 2, list(range(17)))  # 4 blocks match: 3 hit
    live = core.stats("p")
    trace.close()
    records = list(read_trace(tmp_path / "t.jsonl"))
    assert isinstance(records[0], RegisterRecord) and records[0].spec.prefix_hit_margin == 1
    assert live.prefix_cache_hits_tokens == replay(records).hits_tokens == 12
