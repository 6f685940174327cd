"""Chained prefix hashes of full KV blocks.

``h_i = SHA-256(h_{i-1} || extra_i || tokens of block i)`` where ``h_{-1}`` is 32 zero bytes,
tokens are little-endian uint32, and ``extra_0`` is the length-prefixed cache salt (empty for
every other block). Since each hash covers its parent, changing the salt changes every block's
hash from the first on, and a hash identifies the whole prefix up to its block.

SHA-256 is process-stable (unlike Python's ``hash()``) and collision-resistant, so independent
parties (gateway, executor, another block manager) compute the same keys.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

HASH_ALGORITHM = "sha256-chain-v1"
HASH_SIZE = 32
ROOT_HASH = bytes(HASH_SIZE)


def hash_block(parent: bytes, token_ids: Sequence[int], salt: bytes = b"") -> bytes:
    """Hash of one full block given its parent's hash (``ROOT_HASH`` for the first block)."""
    h = hashlib.sha256(parent)
    if salt:
        h.update(struct.pack("<I", len(salt)))
        h.update(salt)
    h.update(struct.pack(f"<{len(token_ids)}I", *token_ids))
    return h.digest()


def block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    salt: bytes = b"",
    *,
    parent: bytes = ROOT_HASH,
    start_block: int = 0,
) -> list[bytes]:
    """Hashes of the full blocks of ``token_ids``, from ``start_block`` on.

    ``parent`` must be the hash of block ``start_block - 1`` (``ROOT_HASH`` when starting at 0),
    which lets a caller extend a chain incrementally as generated tokens fill new blocks.
    """
    if block_size < 1:
        raise ValueError("block_size must be >= 1")
    out: list[bytes] = []
    num_full = len(token_ids) // block_size
    for i in range(start_block, num_full):
        parent = hash_block(
            parent, token_ids[i * block_size : (i + 1) * block_size], salt if i == 0 else b""
        )
        out.append(parent)
    return out
