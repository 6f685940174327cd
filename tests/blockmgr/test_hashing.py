from __future__ import annotations

import hashlib
import struct

from services.blockmgr.api.hashing import HASH_SIZE, ROOT_HASH, block_hashes, hash_block


def test_hashes_are_sha256_of_parent_and_little_endian_tokens():
    expected = hashlib.sha256(ROOT_HASH + struct.pack("<4I", 1, 2, 3, 4)).digest()
    assert block_hashes([1, 2, 3, 4, 5], 4) == [expected]
    assert len(expected) == HASH_SIZE


def test_chain_covers_the_whole_prefix():
    a = block_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4)
    b = block_hashes([9, 2, 3, 4, 5, 6, 7, 8], 4)
    assert a[1] != b[1]  # same second block, different first block


def test_only_full_blocks_are_hashed():
    assert len(block_hashes(list(range(7)), 4)) == 1
    assert block_hashes(list(range(3)), 4) == []


def test_salt_changes_every_hash_from_the_first_block():
    plain = block_hashes(list(range(8)), 4)
    salted = block_hashes(list(range(8)), 4, b"tenant")
    assert plain[0] != salted[0] and plain[1] != salted[1]
    assert salted == block_hashes(list(range(8)), 4, b"tenant")


def test_incremental_extension_equals_hashing_from_scratch():
    tokens = list(range(20))
    whole = block_hashes(tokens, 4, b"s")
    head = block_hashes(tokens[:9], 4, b"s")
    tail = block_hashes(tokens, 4, b"s", parent=head[-1], start_block=len(head))
    assert head + tail == whole
    assert hash_block(whole[0], tokens[4:8]) == whole[1]


def test_hashes_are_process_stable_known_vector():
    # A fixed vector: every party (gateway, executor, other block managers) must compute exactly
    # this; changing it is a deliberate, versioned decision (HASH_ALGORITHM).
    assert block_hashes(list(range(8)), 4, b"salt")[1].hex() == (
        "2102d3046f4c5415b19ccf656e54b99f1bef158d1a5999f61e5b137e145fd448"
    )
