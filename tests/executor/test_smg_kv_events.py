"""The block manager's KV events in SMG's form: stored blocks carry their token ids and 64-bit
hashes in runs chained from their parent, a hash whose tokens are unknown ends its run, a
sliding group is not published, removals and clears map one to one, one batch per event;
the committed blocks' record stays bounded."""

from __future__ import annotations

from smg_grpc_proto.generated import common_pb2 as smg

from services.blockmgr.api.hashing import ROOT_HASH
from services.blockmgr.api.types import AdmitResult, KVEvent, KVEventKind, KVMedium, OpStatus
from services.common.sampling_params import SamplingParams
from services.executor.core.block_tokens import BlockTokens
from services.executor.core.sequence import RequestKey, Sequence
from services.executor.service.smg_kv_events import smg_block_hash, to_smg_batches

BS = 4


def _seq(seq_id: int, tokens: list[int], salt: bytes = b"") -> Sequence:
    params = SamplingParams()
    return Sequence(seq_id, RequestKey(0, f"r{seq_id}"), 0, tokens, len(tokens), params, 0, 0, salt)


def _enabled(capacity: int) -> BlockTokens:
    blocks = BlockTokens(capacity)
    blocks.enable()
    return blocks


def test_nothing_is_recorded_until_a_publisher_enables_it() -> None:
    blocks = BlockTokens(100)
    seq = _seq(1, list(range(8)))
    commit = blocks.commit(seq, BS, 2)
    assert len(commit.block_hashes) == 2 and len(blocks) == 0
    blocks.enable()
    admitted = AdmitResult(OpStatus.OK, num_cached_tokens=7)  # a hit of one full block
    assert blocks.hit(seq, BS, admitted) == 1
    assert blocks.get(commit.block_hashes[0]) == (ROOT_HASH, (0, 1, 2, 3), b"", 0)
    assert blocks.get(commit.block_hashes[1]) is None


def test_a_commit_records_each_blocks_tokens_parent_and_salt() -> None:
    blocks = _enabled(100)
    seq = _seq(1, list(range(10, 22)), b"tenant")
    commit = blocks.commit(seq, BS, 2)
    assert (commit.seq_id, commit.start_block, len(commit.block_hashes)) == (1, 0, 2)
    first, second = (blocks.get(h) for h in commit.block_hashes)
    assert first == (ROOT_HASH, (10, 11, 12, 13), b"tenant", 0)
    assert second == (commit.block_hashes[0], (14, 15, 16, 17), b"", 0)
    seq.num_committed_blocks = 2
    more = blocks.commit(seq, BS, 3)  # the next block, chained to the last committed one
    assert (
        more.start_block == 2 and blocks.get(more.block_hashes[0]).parent == commit.block_hashes[1]
    )
    assert blocks.get(more.block_hashes[0]).token_ids == (18, 19, 20, 21)


def test_the_record_keeps_the_newest_blocks_past_its_capacity() -> None:
    blocks = _enabled(3)
    hashes = [h for i in range(3) for h in blocks.commit(_seq(i, [i] * 8), BS, 2).block_hashes]
    assert len(blocks) == 3 and blocks.get(hashes[0]) is None and blocks.get(hashes[-1])


def test_stored_runs_carry_tokens_and_chain_from_their_parent() -> None:
    blocks = _enabled(100)
    a = blocks.commit(_seq(1, list(range(12)), b"s"), BS, 3).block_hashes
    b = blocks.commit(_seq(2, [*range(8), 50, 51, 52, 53], b"s"), BS, 3).block_hashes  # shares 2
    unknown = b"\x07" * 32
    events = [
        KVEvent(5, 1, KVEventKind.STORED, (*a, b[2], unknown)),
        KVEvent(6, 1, KVEventKind.STORED, a, group=1),  # a sliding group: not published
        KVEvent(7, 1, KVEventKind.REMOVED, (a[2],), medium=KVMedium.HOST),
        KVEvent(8, 1, KVEventKind.CLEARED),
        KVEvent(9, 1, KVEventKind.STORED, (a[2],), medium=KVMedium.DISK),
    ]
    batches = to_smg_batches(events, blocks, BS, frozenset({0}))
    assert [batch.sequence_number for batch in batches] == [5, 7, 8, 9]
    runs = [e.stored for e in batches[0].events]
    assert len(runs) == 2  # a's chain, then b's last block (its parent is a[1], not a[2])
    assert not runs[0].HasField("parent_block_hash") and runs[0].cache_salt == "s"
    assert [list(x.token_ids) for x in runs[0].blocks] == [
        [0, 1, 2, 3],
        [4, 5, 6, 7],
        [8, 9, 10, 11],
    ]
    assert [x.block_hash for x in runs[0].blocks] == [smg_block_hash(h) for h in a]
    assert runs[1].parent_block_hash == smg_block_hash(a[1])
    assert [list(x.token_ids) for x in runs[1].blocks] == [[50, 51, 52, 53]]  # (unknown: skipped)
    assert all(x.block_size == BS and x.cache_level == 0 for r in runs for x in r.blocks)
    removed = batches[1].events[0].removed
    assert list(removed.block_hashes) == [smg_block_hash(a[2])] and removed.cache_level == 1
    assert batches[2].events[0].HasField("cleared")
    on_disk = batches[3].events[0].stored  # a tier's copy: its cache level and tier
    assert on_disk.blocks[0].cache_level == 2 and on_disk.tier == smg.KV_CACHE_TIER_DISK
    assert on_disk.parent_block_hash == smg_block_hash(a[1])


def test_the_64_bit_hash_is_the_first_8_bytes_signed() -> None:
    assert smg_block_hash(b"\xff" * 8 + b"\x00" * 24) == -1
    assert smg_block_hash(b"\x00" * 7 + b"\x05" + b"\x01" * 24) == 5
