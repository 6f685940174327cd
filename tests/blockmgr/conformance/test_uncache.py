"""The contract's ``UncacheOp``: moves that failed (a disk the executor could not read or
write) are reported in a later Step, and what those blocks and slots are cached as is
forgotten, so nothing matches them again; a report of a block or slot holding nothing is
harmless; malformed reports name the field. Skipped against an implementation that
registers no disk tier."""

from __future__ import annotations

from services.blockmgr.api.errors import ErrorCode
from services.blockmgr.api.types import Commit, Free, KVEventKind, KVMedium, PoolSpec, Uncache
from tests.blockmgr.conformance.ops import BS
from tests.blockmgr.conformance.test_disk_tier import PROMPT, _admit, _cache, _register
from tests.blockmgr.helpers import collect_events, hashes, raises_code


def _push_down(client, pool_id, epoch):
    """Cache PROMPT, then push its blocks down to the host and the disk tier; the spills."""
    _cache(client, pool_id, epoch, 1, PROMPT)
    spills = []
    for i in range(2):
        tokens = list(range(1000 * (i + 1), 1000 * (i + 1) + 20))
        spills += _cache(client, pool_id, epoch, 10 + i, tokens).spills
    return spills


def test_a_failed_load_is_forgotten_and_its_tokens_are_no_hit_again(client, pool_id):
    epoch = _register(client, pool_id, 6, 5, 16)
    _push_down(client, pool_id, epoch)
    loaded = _admit(client, pool_id, epoch, 2, [*PROMPT, 7])
    (r,) = loaded.results
    assert r.num_cached_tokens == 16 and loaded.loads
    failed = [m.dst for m in loaded.loads]  # the executor could not read these slots
    stream = client.events(pool_id)
    report = client.step(pool_id, epoch, [Uncache(device_blocks=tuple(failed)), Free((2,))])
    assert report.results[0].num_forgotten == len(failed)
    again = _admit(client, pool_id, epoch, 3, [*PROMPT, 7])
    (r2,) = again.results
    first_failed = min(r.block_ids.index(b) for b in failed)
    assert r2.num_cached_tokens == first_failed * BS  # the hit stops at the first failed block
    removed = collect_events(
        stream, until=lambda got: sum(e.kind is KVEventKind.REMOVED for e in got) >= 1
    )
    assert any(e.kind is KVEventKind.REMOVED and e.medium is KVMedium.DEVICE for e in removed)


def test_a_failed_spill_is_forgotten_and_never_loaded(client, pool_id):
    epoch = _register(client, pool_id, 6, 5, 16)
    spills = _push_down(client, pool_id, epoch)
    assert spills
    bad = {m.dst for m in spills}  # the executor could not write these disk slots
    report = client.step(pool_id, epoch, [Uncache(disk_slots=tuple(sorted(bad)))])
    assert report.results[0].num_forgotten == client.stats(pool_id).num_spilled_blocks
    assert client.stats(pool_id).num_disk_cached_blocks == 0
    again = _admit(client, pool_id, epoch, 2, [*PROMPT, 7])
    assert not {m.src for m in again.loads} & bad


def test_an_uncached_block_in_use_stays_in_its_table_and_is_freed_uncached(client, pool_id):
    epoch = _register(client, pool_id, 8, 4, 8)
    (r,) = _admit(client, pool_id, epoch, 1, PROMPT).results
    client.step(pool_id, epoch, [Commit(1, 0, hashes(PROMPT, BS)[:3])])
    report = client.step(pool_id, epoch, [Uncache(device_blocks=(r.block_ids[1],))])
    assert report.results[0].num_forgotten == 1
    (freed,) = client.step(pool_id, epoch, [Free((1,))]).results  # still in its table
    assert freed.num_freed_blocks == len(r.block_ids)
    (hit,) = _admit(client, pool_id, epoch, 2, [*PROMPT, 7]).results
    assert hit.num_cached_tokens == BS  # block 0 still cached, block 1 forgotten
    # Reporting what holds no key (twice, or a free block) forgets nothing, harmlessly.
    again = client.step(pool_id, epoch, [Uncache(device_blocks=(r.block_ids[1], 7))])
    assert again.results[0].num_forgotten == 0


def test_a_malformed_uncache_names_its_field(client, pool_id):
    epoch = _register(client, pool_id, 8, 4, 8)
    with raises_code(ErrorCode.INVALID_ARGUMENT, "device_blocks[0]"):
        client.step(pool_id, epoch, [Uncache(device_blocks=(8,))])
    with raises_code(ErrorCode.INVALID_ARGUMENT, "device_blocks[0]"):
        client.step(pool_id, epoch, [Uncache(device_blocks=(0,))])
    with raises_code(ErrorCode.INVALID_ARGUMENT, "disk_slots[1]"):
        client.step(pool_id, epoch, [Uncache(disk_slots=(0, 8))])
    with raises_code(ErrorCode.INVALID_ARGUMENT, "ops[1].uncache"):
        client.step(pool_id, epoch, [Free(()), Uncache(host_slots=(0,))])
    epoch = client.register(pool_id, PoolSpec(8, BS)).epoch  # no tiers
    with raises_code(ErrorCode.INVALID_ARGUMENT, "host_slots[0]"):
        client.step(pool_id, epoch, [Uncache(host_slots=(0,))])
    # Nothing was applied: the Step is rejected whole.
    assert client.stats(pool_id).counters.num_sequences == 0
