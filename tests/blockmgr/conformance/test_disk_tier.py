"""The contract's disk tier (``RegisterPoolRequest.disk_blocks``), below the host tier: a host
slot evicted for other content is spilled to a disk slot, a prefix hit goes on through the
host and the disk tiers (disk blocks loaded straight into device blocks), the tiers never
hold one hash twice, and KV events say ``DISK``. Skipped against an implementation that
registers no disk tier."""

from __future__ import annotations

import pytest

from services.blockmgr.api.errors import ErrorCode
from services.blockmgr.api.protocol import BlockManagerClient
from services.blockmgr.api.types import (
    Admit,
    Commit,
    Free,
    KVEventKind,
    KVMedium,
    OpStatus,
    PoolSpec,
    StepResult,
)
from tests.blockmgr.conformance.ops import BS
from tests.blockmgr.helpers import collect_events, hashes, raises_code

PROMPT = list(range(100, 116))  # 4 full blocks


def _register(client: BlockManagerClient, pool_id: str, device: int, host: int, disk: int):
    info = client.register(pool_id, PoolSpec(device, BS, host_blocks=host, disk_blocks=disk))
    if info.disk_blocks != disk:
        pytest.skip("this implementation serves no disk tier")
    return info.epoch


def _admit(client, pool_id, epoch, seq_id, tokens) -> StepResult:
    return client.step(
        pool_id, epoch, [Admit(seq_id, len(tokens), len(tokens), hashes(tokens, BS))]
    )


def _cache(client, pool_id, epoch, seq_id, tokens) -> StepResult:
    """Admit, commit and free: ``tokens``' full blocks are cached free on the device."""
    first = _admit(client, pool_id, epoch, seq_id, tokens)
    client.step(pool_id, epoch, [Commit(seq_id, 0, hashes(tokens, BS)), Free((seq_id,))])
    return first


def test_disk_blocks_are_echoed_and_need_a_host_tier(client, pool_id):
    _register(client, pool_id, 8, 4, 16)
    assert client.stats(pool_id).pool.disk_blocks == 16
    with raises_code(ErrorCode.INVALID_ARGUMENT, "disk_blocks"):
        client.register(pool_id, PoolSpec(8, BS, disk_blocks=4))
    with raises_code(ErrorCode.INVALID_ARGUMENT, "disk_blocks"):
        client.register(pool_id, PoolSpec(8, BS, host_blocks=4, disk_blocks=-1))


def test_host_slots_spill_to_disk_and_a_hit_loads_them_back(client, pool_id):
    epoch = _register(client, pool_id, 6, 5, 16)  # 5 usable device blocks, 5 host slots
    stream = client.events(pool_id)
    _cache(client, pool_id, epoch, 1, PROMPT)
    spilled = []
    for i in range(2):  # other prompts push PROMPT's blocks down: to the host, then the disk
        tokens = list(range(1000 * (i + 1), 1000 * (i + 1) + 20))
        step = _cache(client, pool_id, epoch, 10 + i, tokens)
        # A spill reads its host slot before the Step's offloads write it.
        assert {m.src for m in step.spills} <= {m.host_slot for m in step.offloads}
        spilled += step.spills
    assert spilled, "no host slot was spilled"
    again = _admit(client, pool_id, epoch, 2, [*PROMPT, 7])
    (r,) = again.results
    assert r.num_cached_tokens == 16  # the whole prompt, from wherever it is now
    filled = [m.device_block for m in again.onboards] + [m.dst for m in again.loads]
    assert again.loads and set(filled) <= set(r.block_ids[:4])
    stats = client.stats(pool_id)
    assert stats.disk_hits_tokens == BS * len(again.loads)
    assert stats.num_spilled_blocks >= len(spilled) and stats.num_loaded_blocks == len(again.loads)
    events = collect_events(
        stream, until=lambda got: any(e.medium is KVMedium.DISK for e in got), timeout=5
    )
    disk = [e for e in events if e.medium is KVMedium.DISK]
    assert disk and disk[0].kind is KVEventKind.STORED


def test_a_block_evicted_again_and_again_is_found_once_and_hit(client, pool_id):
    epoch = _register(client, pool_id, 3, 1, 8)  # 2 usable device blocks, 1 host slot
    block = PROMPT[:4]
    for i in range(4):  # the same block cached, then pushed down by other prompts, again
        _cache(client, pool_id, epoch, 10 + i, block)
        _cache(client, pool_id, epoch, 20 + i, list(range(500 + 8 * i, 508 + 8 * i)))
        _cache(client, pool_id, epoch, 30 + i, list(range(900 + 8 * i, 908 + 8 * i)))
    r = _admit(client, pool_id, epoch, 99, [*block, 1])
    assert r.results[0].num_cached_tokens == 4
    assert len(r.onboards) + len(r.loads) == 1  # from one tier, one copy


def test_a_block_loaded_and_reused_in_one_step_keeps_its_disk_slot_and_is_not_loaded(
    client, pool_id
):
    """[Admit (loads K into B), Free, Admit (evicts B)] in one Step: the load of B is
    cancelled (it would overwrite B's next content) and K stays on disk."""
    epoch = _register(client, pool_id, 5, 2, 4)  # 4 usable device blocks, 2 host slots
    block = PROMPT[:4]
    _cache(client, pool_id, epoch, 1, block)  # K cached on the device
    _cache(client, pool_id, epoch, 2, list(range(500, 516)))  # K offloaded to the host
    _cache(client, pool_id, epoch, 3, list(range(600, 616)))  # host full: K spilled to disk
    assert client.stats(pool_id).num_disk_cached_blocks >= 1
    step = client.step(
        pool_id,
        epoch,
        [
            Admit(4, 5, 5, hashes([*block, 1], BS)),
            Free((4,)),
            Admit(5, 16, 16, hashes(list(range(700, 716)), BS)),
        ],
    )
    first, _, second = step.results
    assert first.num_cached_tokens == 4 and second.num_cached_tokens == 0
    loaded_into = first.block_ids[0]
    assert loaded_into in second.block_ids  # reused at once
    assert loaded_into not in {m.dst for m in step.loads}
    client.step(pool_id, epoch, [Free((5,))])
    again = _admit(client, pool_id, epoch, 6, [*block, 2])
    assert again.results[0].num_cached_tokens == 4 and len(again.loads) == 1


def test_the_tiers_eviction_policy_is_echoed_and_an_unknown_one_refused(client, pool_id):
    info = client.register(pool_id, PoolSpec(8, BS, host_blocks=4, tier_eviction_policy="s3fifo"))
    if info.host_blocks != 4:
        pytest.skip("this implementation serves no host tier")
    assert client.stats(pool_id).pool.tier_eviction_policy.value == "s3fifo"
    with raises_code(ErrorCode.INVALID_ARGUMENT, "eviction_policy"):
        client.register(pool_id, PoolSpec(8, BS, host_blocks=4, tier_eviction_policy="fifo"))


def test_offloads_beyond_the_host_tier_go_straight_to_disk(client, pool_id):
    """A Step that evicts more device blocks than the host tier has slots: the offloads
    whose slot a later one takes again are stores (device block -> disk slot), made before
    any fill, so no evicted block is lost and the next turn hits its whole prompt."""
    epoch = _register(client, pool_id, 6, 1, 16)  # 5 usable device blocks, 1 host slot
    first = _cache(client, pool_id, epoch, 1, PROMPT)
    cached = set(first.results[0].block_ids[:4])
    other = _admit(client, pool_id, epoch, 2, list(range(1000, 1020)))  # takes all 5 blocks
    assert other.results[0].status is OpStatus.OK
    assert len(other.stores) == 3 and len(other.offloads) == 1
    assert {m.src for m in other.stores} | {m.device_block for m in other.offloads} == cached
    assert len({m.dst for m in other.stores}) == 3
    client.step(pool_id, epoch, [Free((2,))])
    again = _admit(client, pool_id, epoch, 3, [*PROMPT, 7])
    assert again.results[0].num_cached_tokens == 16
    assert len(again.loads) == 3 and client.stats(pool_id).disk_hits_tokens == 3 * BS
