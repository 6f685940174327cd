"""Traces at the core: a replay as recorded matches the live pool even when empty Steps (the
pool's clock) drive retention priorities out, and a tier override skips the pools that cannot
have one."""

from __future__ import annotations

from services.blockmgr.client import InProcessClient
from services.blockmgr.core import BlockManagerCore
from services.blockmgr.replay import replay
from services.blockmgr.trace import TraceWriter, read_trace
from services.blockmgr.types import Admit, AttentionKindName, Commit, Free, KVCacheGroup
from tests.blockmgr.helpers import hashes

BS = 4


def _turn(core, epoch, seq_id, tokens, priority=0):
    h = hashes(tokens, BS)
    core.step("p", epoch, [Admit(seq_id, len(tokens), len(tokens), h, 0, priority)])
    core.step("p", epoch, [Commit(seq_id, 0, h), Free((seq_id,))])


def test_a_replay_counts_empty_steps_as_the_pools_clock(tmp_path):
    trace = TraceWriter(tmp_path / "t.jsonl")
    core = InProcessClient(BlockManagerCore(trace=trace, retention_steps=6))
    epoch = core.register("p", 9, BS).epoch  # 8 usable
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
    epoch = core.register("p", 9, BS, groups=[sliding]).epoch
    _turn(core, epoch, 1, list(range(16)))
    trace.close()
    result = replay(list(read_trace(tmp_path / "t.jsonl")), host_blocks=4)
    assert result.num_offloaded_blocks == 0 and result.queries_tokens == 16
