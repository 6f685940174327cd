"""The token ids behind the block hashes an engine commits, for KV-event consumers that hash
content on their own side: SMG's router indexes each stored block's ``token_ids`` (and its
parent's hash), not our SHA-256 chain, so publishing our events in its form needs the tokens
of every hash the block manager reports stored.

The scheduler records each block as it commits it; a publisher reads them as the block
manager's STORED events arrive (a REMOVED one does not drop them: the content may still be
stored again, in a tier). Bounded: past ``capacity`` entries (about twice the pool) the
oldest go first, so a STORED event read long after its commit (a block offloaded to the host
tier much later) may find no tokens; its publisher skips it. Read and written from
different threads (the engine's, the event relay's): one lock.
"""

from __future__ import annotations

import threading
from typing import NamedTuple

from services.blockmgr.api.hashing import ROOT_HASH
from services.blockmgr.api.types import Commit
from services.executor.core.sequence import Sequence

__all__ = ["BlockContent", "BlockTokens"]


class BlockContent(NamedTuple):
    parent: bytes  # the previous block's hash (ROOT_HASH for a sequence's first block)
    token_ids: tuple[int, ...]
    cache_salt: bytes  # folded into a first block's hash (empty for the others)
    lora_id: int  # the adapter version its KV was computed with (0: the base model)


class BlockTokens:
    def __init__(self, capacity: int) -> None:
        self.capacity = max(1, capacity)
        self._blocks: dict[bytes, BlockContent] = {}
        self._lock = threading.Lock()

    def commit(self, seq: Sequence, block_size: int, full: int) -> Commit:
        """The commit of ``seq``'s blocks from its last committed one up to ``full`` (its
        hashes chained over its tokens), each block's content recorded."""
        start = seq.num_committed_blocks
        hashes = seq.full_block_hashes(block_size)[start:full]
        with self._lock:
            for i, block_hash in enumerate(hashes, start):
                parent = seq.block_hashes[i - 1] if i else ROOT_HASH
                tokens = tuple(seq.token_ids[i * block_size : (i + 1) * block_size])
                salt = seq.cache_salt if i == 0 else b""
                self._blocks.pop(block_hash, None)  # (re-inserted: the newest again)
                self._blocks[block_hash] = BlockContent(parent, tokens, salt, seq.lora_id)
            while len(self._blocks) > self.capacity:
                del self._blocks[next(iter(self._blocks))]
        return Commit(seq.seq_id, start, tuple(hashes))

    def get(self, block_hash: bytes) -> BlockContent | None:
        with self._lock:
            return self._blocks.get(block_hash)

    def __len__(self) -> int:
        return len(self._blocks)
