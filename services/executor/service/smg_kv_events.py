"""The block manager's KV events in SMG's form, for ``SubscribeKvEvents``: the input of the
router's event-driven prefix index.

SMG hashes each stored block's ``token_ids`` itself (chained from its parent's hash), so a
STORED event becomes ``KvBlocksStored`` runs, one per chain of consecutive blocks, each block
with its tokens (:class:`~services.executor.core.block_tokens.BlockTokens`) and a 64-bit
hash (the first 8 bytes of ours, signed), the run's parent hash and the tier. REMOVED
becomes ``KvBlocksRemoved``, CLEARED (the pool registered anew) ``KvCacheCleared``. Only
full-attention groups are published: a sliding group's blocks feed no prefix index (a model
whose every layer slides publishes none). Blocks computed with a LoRA adapter are left out:
their hashes fold in our adapter key, which SMG's request side cannot rebuild. Each
event is one batch, numbered by its sequence number (the block manager's, increasing per
pool across restarts), so a subscriber resumes exactly where it left off.
"""

from __future__ import annotations

import time

from smg_grpc_proto.generated import common_pb2 as smg

from services.blockmgr.api.hashing import ROOT_HASH
from services.blockmgr.api.types import KVEvent, KVEventKind, KVMedium
from services.executor.core.block_tokens import BlockContent, BlockTokens

__all__ = ["smg_block_hash", "to_smg_batches"]

_TIERS = {
    KVMedium.DEVICE: (smg.KV_CACHE_TIER_DEVICE, 0, "GPU"),
    KVMedium.HOST: (smg.KV_CACHE_TIER_HOST, 1, "CPU"),
    KVMedium.DISK: (smg.KV_CACHE_TIER_DISK, 2, "DISK"),
}


def smg_block_hash(block_hash: bytes) -> int:
    """Our 32-byte hash as SMG's signed 64-bit one (its first 8 bytes, big-endian)."""
    return int.from_bytes(block_hash[:8], "big", signed=True)


def _stored_runs(event: KVEvent, blocks: BlockTokens, block_size: int) -> list[smg.KvBlocksStored]:
    """One message per run of chained blocks whose tokens are known (a hash without them
    ends its run and is skipped: recorded too long ago, see ``BlockTokens``)."""
    tier, level, medium = _TIERS[event.medium]
    runs: list[smg.KvBlocksStored] = []
    previous: bytes | None = None
    for block_hash in event.block_hashes:
        content: BlockContent | None = blocks.get(block_hash)
        if content is None or content.lora_id:
            previous = None  # (unknown; or an adapter's, whose key SMG cannot rebuild)
            continue
        if previous is None or content.parent != previous:
            run = smg.KvBlocksStored(
                tier=tier,
                medium=medium,
                group_idx=event.group,
                kv_cache_spec_kind="full_attention",
                locality=smg.KV_CACHE_LOCALITY_LOCAL,
            )
            if content.parent != ROOT_HASH:
                run.parent_block_hash = smg_block_hash(content.parent)
            elif content.cache_salt:
                run.cache_salt = content.cache_salt.decode("utf-8", "replace")
            runs.append(run)
        runs[-1].blocks.add(
            block_hash=smg_block_hash(block_hash),
            token_ids=content.token_ids,
            block_size=block_size,
            cache_level=level,
        )
        previous = block_hash
    return runs


def to_smg_batches(
    events: list[KVEvent],
    blocks: BlockTokens,
    block_size: int,
    full_groups: frozenset[int],
) -> list[smg.KvEventBatch]:
    """``events`` (one delivery of the block manager's stream) as SMG batches, one per event
    that publishes anything, numbered by its sequence number."""
    batches: list[smg.KvEventBatch] = []
    for event in events:
        out: list[smg.KvCacheEvent] = []
        if event.kind is KVEventKind.CLEARED:
            out.append(smg.KvCacheEvent(event_id=event.seq, cleared=smg.KvCacheCleared()))
        elif event.group not in full_groups:
            continue
        elif event.kind is KVEventKind.STORED:
            for run in _stored_runs(event, blocks, block_size):
                out.append(smg.KvCacheEvent(event_id=event.seq, stored=run))
        else:
            tier, level, medium = _TIERS[event.medium]
            removed = smg.KvBlocksRemoved(
                block_hashes=[smg_block_hash(h) for h in event.block_hashes],
                cache_level=level,
                tier=tier,
                medium=medium,
                group_idx=event.group,
                locality=smg.KV_CACHE_LOCALITY_LOCAL,
            )
            out.append(smg.KvCacheEvent(event_id=event.seq, removed=removed))
        if out:
            batch = smg.KvEventBatch(sequence_number=event.seq, timestamp=time.time(), events=out)
            batches.append(batch)
    return batches
