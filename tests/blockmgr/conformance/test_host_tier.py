"""The contract's host tier (``RegisterPoolRequest.host_blocks``): blocks evicted from the
device are offloaded into host slots, an admission continues its prefix hit there and gets
its blocks onboarded, a slot an onboard reads is not overwritten in the same Step, and KV
events say which medium a hash is in. Skipped against an implementation that registers no
host tier (``PoolInfo.host_blocks`` echoed as 0)."""

from __future__ import annotations

import pytest

from services.blockmgr.api.errors import ErrorCode
from services.blockmgr.api.protocol import BlockManagerClient
from services.blockmgr.api.types import (
    Admit,
    AttentionKindName,
    Commit,
    Free,
    KVCacheGroup,
    KVEventKind,
    KVMedium,
    OpStatus,
    PoolSpec,
    StepResult,
)
from tests.blockmgr.conformance.ops import BS
from tests.blockmgr.helpers import collect_events, hashes, raises_code

PROMPT = list(range(100, 116))  # 4 full blocks


def _register(client: BlockManagerClient, pool_id: str, num_blocks: int, host: int) -> int:
    info = client.register(pool_id, PoolSpec(num_blocks, BS, host_blocks=host))
    if info.host_blocks != host:
        pytest.skip("this implementation serves no host tier")
    return info.epoch


def _admit(client, pool_id, epoch, seq_id, tokens) -> StepResult:
    op = Admit(seq_id, len(tokens), len(tokens), hashes(tokens, BS))
    return client.step(pool_id, epoch, [op])


def _cache(client, pool_id, epoch, seq_id, tokens) -> None:
    """Admit, commit and free: ``tokens``' full blocks are cached free on the device."""
    _admit(client, pool_id, epoch, seq_id, tokens)
    client.step(pool_id, epoch, [Commit(seq_id, 0, hashes(tokens, BS)), Free((seq_id,))])


def test_host_blocks_are_echoed_and_refused_out_of_range(client, pool_id):
    _register(client, pool_id, 8, 16)
    assert client.stats(pool_id).pool.host_blocks == 16
    sliding = KVCacheGroup(AttentionKindName.SLIDING, 8)
    client.register(
        pool_id, PoolSpec(8, BS, groups=tuple([sliding]), host_blocks=4)
    )  # any pool has tiers
    assert client.stats(pool_id).pool.host_blocks == 4
    with raises_code(ErrorCode.INVALID_ARGUMENT, "host_blocks"):
        client.register(pool_id, PoolSpec(8, BS, host_blocks=-1))


def test_a_block_evicted_from_the_device_is_offloaded_then_onboarded_on_a_hit(client, pool_id):
    epoch = _register(client, pool_id, 6, 8)  # 5 usable device blocks
    stream = client.events(pool_id)
    first = _admit(client, pool_id, epoch, 1, PROMPT)
    client.step(pool_id, epoch, [Commit(1, 0, hashes(PROMPT, BS)), Free((1,))])
    # 5 fresh blocks: the free uncached one, then the 4 cached ones, each offloaded first.
    other = _admit(client, pool_id, epoch, 2, list(range(500, 520)))
    assert sorted(m.device_block for m in other.offloads) == sorted(first.results[0].block_ids)
    assert len({m.host_slot for m in other.offloads}) == 4 and other.onboards == ()
    client.step(pool_id, epoch, [Free((2,))])
    again = _admit(client, pool_id, epoch, 3, [*PROMPT, 7])
    (r,) = again.results
    assert r.status is OpStatus.OK and r.num_cached_tokens == 16
    assert [m.device_block for m in again.onboards] == list(r.block_ids[:4])
    assert sorted(m.host_slot for m in again.onboards) == sorted(
        m.host_slot for m in other.offloads
    )
    stats = client.stats(pool_id)
    assert (stats.host_hits_tokens, stats.prefix_cache_hits_tokens) == (16, 16)
    assert (stats.num_offloaded_blocks, stats.num_onboarded_blocks) == (4, 4)
    events = collect_events(
        stream, until=lambda got: any(e.medium is KVMedium.HOST for e in got), timeout=5
    )
    host = [e for e in events if e.medium is KVMedium.HOST]
    assert host[0].kind is KVEventKind.STORED
    assert set(host[0].block_hashes) <= set(hashes(PROMPT, BS))


def test_a_device_hit_goes_on_in_the_host_tier(client, pool_id):
    epoch = _register(client, pool_id, 8, 8)  # 7 usable
    _cache(client, pool_id, epoch, 1, PROMPT)
    # 7 blocks sharing PROMPT's first 2: its last 2 (freed first) are evicted, offloaded.
    _cache(client, pool_id, epoch, 2, [*PROMPT[:8], *range(900, 920)])
    r = _admit(client, pool_id, epoch, 3, [*PROMPT, 7])
    (admitted,) = r.results
    assert admitted.num_cached_tokens == 16  # 2 blocks on the device, 2 from the host
    assert [m.device_block for m in r.onboards] == list(admitted.block_ids[2:4])


def test_a_slot_an_onboard_reads_is_not_overwritten_in_the_same_step(client, pool_id):
    epoch = _register(client, pool_id, 4, 1)  # 3 usable device blocks, 1 host slot
    _cache(client, pool_id, epoch, 1, PROMPT[:4])  # block A
    _cache(client, pool_id, epoch, 2, PROMPT[4:8])  # block B
    _admit(client, pool_id, epoch, 3, list(range(700, 712)))  # 3 blocks: A, B evicted
    client.step(pool_id, epoch, [Free((3,))])  # (A was offloaded, then B took A's slot)
    # B's block comes back from the slot while the admission's other block evicts a device
    # block: that offload may not take the slot being read.
    r = _admit(client, pool_id, epoch, 4, [*PROMPT[4:8], 1, 2])
    assert [m.host_slot for m in r.onboards] == [0]
    assert all(m.host_slot != 0 for m in r.offloads)


def test_host_slots_are_reused_least_recently_used_first(client, pool_id):
    epoch = _register(client, pool_id, 3, 2)  # 2 usable device blocks, 2 host slots
    stream = client.events(pool_id)
    for i in range(4):  # each one-block prompt evicts the one before
        _cache(client, pool_id, epoch, i, list(range(10 * i, 10 * i + 4)))
    _admit(client, pool_id, epoch, 9, list(range(90, 98)))  # evicts the last two: offloaded
    events = collect_events(
        stream,
        until=lambda got: any(
            e.kind is KVEventKind.REMOVED and e.medium is KVMedium.HOST for e in got
        ),
        timeout=5,
    )
    removed = [
        h
        for e in events
        if e.medium is KVMedium.HOST and e.kind is KVEventKind.REMOVED
        for h in e.block_hashes
    ]
    assert removed and removed[0] == hashes(list(range(0, 4)), BS)[0]  # the oldest offload
    assert client.stats(pool_id).num_host_cached_blocks == 2


def test_a_block_onboarded_and_evicted_in_one_step_is_never_read_before_it_is_filled(
    client, pool_id
):
    """[Admit (onboards K into D), Free, Admit (evicts D)] in one Step: the offloads run
    before the onboards, so none may read D, and D's onboard is cancelled (D's next content
    comes after it); K stays in its slot."""
    epoch = _register(client, pool_id, 3, 4)  # 2 usable device blocks
    _cache(client, pool_id, epoch, 1, PROMPT[:4])
    _admit(client, pool_id, epoch, 2, list(range(700, 708)))  # evicts it: offloaded
    client.step(pool_id, epoch, [Free((2,))])
    ops = [
        Admit(3, 5, 5, hashes([*PROMPT[:4], 1], BS)),  # onboards PROMPT[:4]
        Free((3,)),
        Admit(4, 8, 8, hashes(list(range(800, 808)), BS)),  # 2 blocks: evicts the onboarded
    ]
    r = client.step(pool_id, epoch, ops)
    (first, _, second) = r.results
    assert first.num_cached_tokens == 4 and first.block_ids[0] in second.block_ids
    onboarded = {m.device_block for m in r.onboards}
    assert first.block_ids[0] not in onboarded
    assert not onboarded & {m.device_block for m in r.offloads}
    assert len({m.host_slot for m in r.offloads}) == len(r.offloads)
    client.step(pool_id, epoch, [Free((4,))])
    again = _admit(client, pool_id, epoch, 5, [*PROMPT[:4], 1])
    assert again.results[0].num_cached_tokens == 4 and len(again.onboards) == 1
