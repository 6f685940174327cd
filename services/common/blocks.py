"""Block arithmetic: the one place that says how tokens map onto fixed-size KV blocks.

A pool of ``num_blocks`` blocks reserves block :data:`NULL_BLOCK` (0): it is never handed
out, padded block-table rows point at it, and padding tokens of a batch read it. So a pool
has :func:`usable_blocks` = ``num_blocks - 1`` blocks to give. Block ``i`` of a sequence
holds its tokens ``[i * block_size, (i + 1) * block_size)``.

Used alike by the block manager (what it allocates), the executor's scheduler (what it
plans and checks) and the batch builder (which blocks a step reads). The vectorised numpy
forms take arrays where the scalar forms take ints.
"""

from __future__ import annotations

from typing import overload

import numpy as np

__all__ = [
    "MIN_NUM_BLOCKS",
    "NULL_BLOCK",
    "blocks_for_tokens",
    "blocks_to_grow",
    "first_live_block",
    "full_blocks",
    "max_live_blocks",
    "needs_cow",
    "usable_blocks",
]

NULL_BLOCK = 0  # reserved: never allocated; the padding of block tables
MIN_NUM_BLOCKS = 2  # the reserved block plus one usable block


@overload
def blocks_for_tokens(num_tokens: int, block_size: int) -> int: ...
@overload
def blocks_for_tokens(num_tokens: np.ndarray, block_size: int) -> np.ndarray: ...
def blocks_for_tokens(num_tokens: int | np.ndarray, block_size: int) -> int | np.ndarray:
    """Blocks that hold ``num_tokens`` tokens: ``ceil(num_tokens / block_size)``."""
    return -(-num_tokens // block_size)


def full_blocks(num_tokens: int, block_size: int) -> int:
    """Blocks that ``num_tokens`` tokens fill completely (the hashable, committable ones)."""
    return num_tokens // block_size


def blocks_to_grow(num_tokens: int, num_new_tokens: int, num_held: int, block_size: int) -> int:
    """New blocks a sequence holding ``num_held`` blocks for ``num_tokens`` tokens needs to
    take ``num_new_tokens`` more (0 when its last block has room). Called per sequence per
    step by the block manager: one expression, no nested call."""
    need = -(-(num_tokens + num_new_tokens) // block_size) - num_held
    return need if need > 0 else 0


def slots_after_grow(num_tokens: int, num_slots: int, num_new_tokens: int, lookahead: int) -> int:
    """The token slots a sequence holding ``num_slots`` slots for ``num_tokens`` (verified)
    tokens holds after a grow by ``num_new_tokens`` with ``lookahead`` slots beyond them
    (speculative decoding's drafts): slots are never given back by a grow."""
    slots = num_tokens + num_new_tokens + lookahead
    return slots if slots > num_slots else num_slots


def usable_blocks(num_blocks: int) -> int:
    """Blocks of a pool of ``num_blocks`` that can be handed out (all but the null block)."""
    return num_blocks - 1


def needs_cow(num_tokens: int, num_new_tokens: int, block_size: int, last_block_refs: int) -> bool:
    """Whether growing a sequence that holds ``num_tokens`` slots by ``num_new_tokens`` must
    first give it a private copy of its last block: the new tokens land in that block (it is
    only partly filled) and another table holds it too (``last_block_refs > 1``)."""
    return num_new_tokens > 0 and num_tokens % block_size != 0 and last_block_refs > 1


def first_live_block(first_query_pos: int, sliding_window: int, block_size: int) -> int:
    """The first block a sliding window of ``sliding_window`` tokens may still read when the
    earliest query still to come is at ``first_query_pos``: a query at position p reads the
    keys in (p - W, p], so every block whose last position is <= p - W is out of the window
    for good. 0 for full attention (``sliding_window == 0``)."""
    if not sliding_window:
        return 0
    return max(0, (first_query_pos - sliding_window + 1) // block_size)


def max_live_blocks(sliding_window: int, block_size: int) -> int:
    """The most blocks a decoding sequence holds in a sliding-window pool:
    ``ceil(W / block_size) + 1`` (the window straddles one more block than it fills)."""
    return -(-sliding_window // block_size) + 1
