"""The token ids behind the block hashes an engine commits, for KV-event consumers that hash
content on their own side: SMG's router indexes each stored block's ``token_ids`` (and its
parent's hash), not our SHA-256 chain, so publishing our events in its form needs the tokens
of every hash the block manager reports stored.

Off until a publisher turns it on (:meth:`BlockTokens.enable`, at its first subscriber):
from then on the scheduler records each block it commits, and refreshes the blocks each
admission hits (a hot system prompt, a prefix filled from a tier), so that the content a
later STORED event names (an offload to the host tier, an onboard) is usually still known.
A REMOVED event does not drop a record: the content may still be stored again, in a tier.
Bounded: past ``capacity`` entries (about twice the pool) the least recently committed or
hit go first, so a STORED event about content neither committed nor hit for that long finds
no tokens; its publisher skips it. Read and written from different threads (the engine's,
the event relay's): one lock.
"""

from __future__ import annotations

import threading
from typing import NamedTuple

from services.blockmgr.api.hashing import ROOT_HASH
from services.blockmgr.api.types import AdmitResult, Commit
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
        self.enabled = False
        self._blocks: dict[bytes, BlockContent] = {}
        self._lock = threading.Lock()

    def enable(self) -> None:
        """Record from now on (blocks committed or hit before are not known)."""
        self.enabled = True

    def commit(self, seq: Sequence, block_size: int, full: int) -> Commit:
        """The commit of ``seq``'s blocks from its last committed one up to ``full`` (its
        hashes chained over its tokens), each block's content recorded (when enabled)."""
        start = seq.num_committed_blocks
        hashes = seq.full_block_hashes(block_size)[start:full]
        if self.enabled:
            self._record(seq, block_size, start, hashes)
        return Commit(seq.seq_id, start, tuple(hashes))

    def hit(self, seq: Sequence, block_size: int, admitted: AdmitResult) -> int:
        """The number of ``seq``'s blocks its admission found cached (its committed blocks
        from now on), their content recorded again as the newest (when enabled)."""
        full = admitted.num_cached_tokens // block_size
        if self.enabled and full:
            self._record(seq, block_size, 0, seq.full_block_hashes(block_size)[:full])
        return full

    def _record(self, seq: Sequence, block_size: int, start: int, hashes: list[bytes]) -> None:
        with self._lock:
            for i, block_hash in enumerate(hashes, start):
                parent = seq.block_hashes[i - 1] if i else ROOT_HASH
                tokens = tuple(seq.token_ids[i * block_size : (i + 1) * block_size])
                salt = seq.cache_salt if i == 0 else b""
                self._blocks.pop(block_hash, None)  # (re-inserted: the newest again)
                self._blocks[block_hash] = BlockContent(parent, tokens, salt, seq.lora_id)
            while len(self._blocks) > self.capacity:
                del self._blocks[next(iter(self._blocks))]

    def get(self, block_hash: bytes) -> BlockContent | None:
        with self._lock:
            return self._blocks.get(block_hash)

    def __len__(self) -> int:
        return len(self._blocks)
