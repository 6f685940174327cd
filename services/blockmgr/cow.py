"""The copy-on-write rule, shared by the block manager and the executor's refcount mirror."""

from __future__ import annotations


def needs_cow(num_tokens: int, num_new_tokens: int, block_size: int, last_block_refs: int) -> bool:
    """Whether growing a sequence that holds ``num_tokens`` slots by ``num_new_tokens`` must
    first give it a private copy of its last block: the new tokens land in that block (it is
    only partly filled) and another table holds it too (``last_block_refs > 1``)."""
    return num_new_tokens > 0 and num_tokens % block_size != 0 and last_block_refs > 1
