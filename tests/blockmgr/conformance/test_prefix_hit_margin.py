"""The contract's prefix hit margin (``RegisterPoolRequest.prefix_hit_margin``, for EAGLE
speculative decoding): an admission's hit stops that many blocks short of the run of committed
blocks that match (the run as computed without it: never the last prompt token, every tier
and group); the blocks dropped are allocated fresh. Skipped against an implementation that
echoes no margin (``PoolInfo.prefix_hit_margin`` 0 for a pool registered with one)."""

from __future__ import annotations

import pytest

from services.blockmgr.api.errors import ErrorCode
from services.blockmgr.api.protocol import BlockManagerClient
from services.blockmgr.api.types import (
    Admit,
    AdmitResult,
    AttentionKindName,
    Commit,
    Free,
    KVCacheGroup,
    PoolSpec,
)
from tests.blockmgr.conformance.ops import BS, admit, in_use
from tests.blockmgr.helpers import hashes, raises_code

PROMPT = list(range(100, 116))  # 4 full blocks
NUM_BLOCKS = 17  # 16 usable


def _register(client: BlockManagerClient, pool_id: str, margin: int, **kw) -> int:
    info = client.register(pool_id, PoolSpec(NUM_BLOCKS, BS, prefix_hit_margin=margin, **kw))
    if info.prefix_hit_margin != margin:
        pytest.skip("this implementation serves no prefix hit margin")
    return info.epoch


def _commit(client, pool_id, epoch, seq_id, tokens, *, free: bool = False) -> None:
    ops = [Commit(seq_id, 0, hashes(tokens, BS)), *([Free((seq_id,))] if free else [])]
    client.step(pool_id, epoch, ops)


def test_the_margin_is_echoed_and_a_negative_one_refused(client, pool_id):
    _register(client, pool_id, 2)
    assert client.info(pool_id).pools[0].prefix_hit_margin == 2
    assert client.stats(pool_id).pool.prefix_hit_margin == 2
    assert client.register(pool_id, PoolSpec(NUM_BLOCKS, BS)).prefix_hit_margin == 0
    with raises_code(ErrorCode.INVALID_ARGUMENT, "prefix_hit_margin"):
        client.register(pool_id, PoolSpec(NUM_BLOCKS, BS, prefix_hit_margin=-1))


@pytest.mark.parametrize(
    ("margin", "prompt", "hit_blocks"),
    [
        (0, [*PROMPT, 7], 4),  # the whole run
        (1, [*PROMPT, 7], 3),
        (3, [*PROMPT, 7], 1),
        (5, [*PROMPT, 7], 0),  # a margin beyond the run: no hit
        (1, PROMPT, 2),  # the run never covers the last prompt token: 3 blocks, less 1
        (1, PROMPT[:5], 0),  # a run of one block
    ],
)
def test_the_hit_stops_margin_blocks_short_of_the_matched_run(
    client, pool_id, margin, prompt, hit_blocks
):
    epoch = _register(client, pool_id, margin)
    a = admit(client, pool_id, epoch, 1, PROMPT)
    _commit(client, pool_id, epoch, 1, PROMPT)  # seq 1 stays live: its blocks stay in use
    r = admit(client, pool_id, epoch, 2, prompt)
    assert r.num_cached_tokens == hit_blocks * BS and r.num_tokens == len(prompt)
    assert r.block_ids[:hit_blocks] == a.block_ids[:hit_blocks]
    assert not set(r.block_ids[hit_blocks:]) & {0, *a.block_ids}  # dropped blocks: new
    new = len(r.block_ids) - hit_blocks
    assert in_use(client, pool_id) == len(a.block_ids) + new
    counters = client.stats(pool_id).counters
    assert counters.num_free_blocks == NUM_BLOCKS - 1 - len(a.block_ids) - new
    assert client.stats(pool_id).prefix_cache_hits_tokens == hit_blocks * BS


def test_a_dropped_cached_block_is_not_taken_and_stays_cached(client, pool_id):
    epoch = _register(client, pool_id, 1)
    admit(client, pool_id, epoch, 1, PROMPT)
    _commit(client, pool_id, epoch, 1, PROMPT, free=True)  # 4 cached free blocks
    r = admit(client, pool_id, epoch, 2, [*PROMPT, 7])
    assert r.num_cached_tokens == 12
    counters = client.stats(pool_id).counters
    assert counters.num_in_use_blocks == 5  # 3 hit, 2 fresh
    assert counters.num_cached_free_blocks == 1  # the dropped block, still matchable
    client.step(pool_id, epoch, [Free((2,))])
    again = admit(client, pool_id, epoch, 3, [*PROMPT, 7])
    assert again.num_cached_tokens == 12


@pytest.mark.parametrize(("margin", "hit_blocks", "onboarded"), [(0, 4, 2), (1, 3, 1), (3, 1, 0)])
def test_the_margin_shortens_a_hit_that_goes_on_in_the_host_tier(
    client, pool_id, margin, hit_blocks, onboarded
):
    info = client.register(pool_id, PoolSpec(8, BS, host_blocks=8, prefix_hit_margin=margin))
    if info.host_blocks != 8 or info.prefix_hit_margin != margin:
        pytest.skip("this implementation serves no host tier or no prefix hit margin")
    epoch = info.epoch  # 7 usable device blocks
    admit(client, pool_id, epoch, 1, PROMPT)
    _commit(client, pool_id, epoch, 1, PROMPT, free=True)
    # 7 blocks sharing PROMPT's first 2: its last 2 (freed first) are evicted, offloaded.
    other = [*PROMPT[:8], *range(900, 920)]
    admit(client, pool_id, epoch, 2, other)
    _commit(client, pool_id, epoch, 2, other, free=True)
    prompt = [*PROMPT, 7]
    res = client.step(pool_id, epoch, [Admit(3, len(prompt), len(prompt), hashes(prompt, BS))])
    (r,) = res.results
    assert isinstance(r, AdmitResult)
    assert r.num_cached_tokens == hit_blocks * BS
    assert [m.device_block for m in res.onboards] == list(r.block_ids[2:hit_blocks])
    assert len(res.onboards) == onboarded
    assert client.stats(pool_id).host_hits_tokens == onboarded * BS


def test_with_a_sliding_group_the_hit_is_that_of_the_shorter_prefix(client, pool_id):
    if client.info().max_kv_cache_groups == 0:
        pytest.skip("this implementation predates KV-cache groups (max_kv_cache_groups == 0)")
    sliding = KVCacheGroup(AttentionKindName.SLIDING, 8)  # a query at p reads (p - 8, p]
    epoch = _register(client, pool_id, 1, groups=(sliding,))
    history = list(range(24))  # 6 blocks
    a = admit(client, pool_id, epoch, 1, history)
    _commit(client, pool_id, epoch, 1, history)
    # Without the margin: 6 blocks hit (queries from 24 read blocks 4, 5). With it: the hit of
    # the first 5, whose queries (from 20) read blocks 3 and 4; the table is null before them.
    r = admit(client, pool_id, epoch, 2, [*history, 90, 91])
    assert r.num_cached_tokens == 20 and r.num_tokens == 26
    assert r.block_ids[:3] == (0, 0, 0) and r.block_ids[3:5] == a.block_ids[3:5]
    assert not set(r.block_ids[5:]) & {0, *a.block_ids}
    assert in_use(client, pool_id) == 6 + 2
