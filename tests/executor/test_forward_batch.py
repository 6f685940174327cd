"""Flattening per-sequence chunks into the tensors of one forward pass."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from services.executor.model.forward_batch import (
    BatchBuilder,
    ForwardBatch,
    SeqChunk,
    build_forward_batch,
)
from tests.hypothesis_budget import examples


def test_decode_prefill_and_cache_hit_chunks_flatten_to_exact_tensors() -> None:
    block_size = 4
    chunks = [
        SeqChunk([7], num_computed_tokens=5, block_table=[3, 9]),  # decode at position 5
        SeqChunk([1, 2, 3], num_computed_tokens=0, block_table=[4, 5, 6], need_logits=False),
        SeqChunk([8, 8], num_computed_tokens=4, block_table=[2, 11, 12]),  # after a cache hit
    ]
    b = build_forward_batch(chunks, block_size, "cpu")
    assert b.input_ids.tolist() == [7, 1, 2, 3, 8, 8]
    assert b.positions.tolist() == [5, 0, 1, 2, 4, 5]
    # position p of a sequence -> block_table[p // 4] * 4 + p % 4
    assert b.slot_mapping.tolist() == [9 * 4 + 1, 16, 17, 18, 11 * 4 + 0, 11 * 4 + 1]
    # Tables cover the blocks touched this step (trailing unused entries dropped), 0-padded.
    assert b.block_tables.tolist() == [[3, 9], [4, 0], [2, 11]]
    assert b.query_start_loc.tolist() == [0, 1, 4, 6]
    assert b.seq_lens.tolist() == [6, 3, 6]
    assert b.logits_indices.tolist() == [0, 5]
    assert (b.max_query_len, b.max_seq_len, b.num_tokens, b.num_seqs) == (3, 6, 6, 3)
    assert b.input_ids.dtype == b.positions.dtype == b.slot_mapping.dtype == torch.int64
    assert b.logits_indices.dtype == torch.int64
    assert b.block_tables.dtype == b.query_start_loc.dtype == b.seq_lens.dtype == torch.int32


def _naive(chunks: list[SeqChunk], block_size: int) -> dict[str, list]:
    """Per-token Python reference of the builder."""
    out: dict[str, list] = {
        "input_ids": [],
        "positions": [],
        "slot_mapping": [],
        "qsl": [0],
        "seq_lens": [],
        "logits_indices": [],
    }
    for c in chunks:
        for i, token in enumerate(c.token_ids):
            pos = c.num_computed_tokens + i
            out["input_ids"].append(token)
            out["positions"].append(pos)
            out["slot_mapping"].append(
                c.block_table[pos // block_size] * block_size + pos % block_size
            )
        out["qsl"].append(out["qsl"][-1] + len(c.token_ids))
        out["seq_lens"].append(c.num_computed_tokens + len(c.token_ids))
        if c.need_logits:
            out["logits_indices"].append(out["qsl"][-1] - 1)
    return out


@st.composite
def _chunks(draw: st.DrawFn) -> tuple[list[SeqChunk], int]:
    block_size = draw(st.sampled_from([1, 2, 4, 16]))
    chunks = []
    for _ in range(draw(st.integers(1, 6))):
        num_computed = draw(st.integers(0, 40))
        tokens = draw(st.lists(st.integers(0, 999), min_size=1, max_size=20))
        num_blocks = -(-(num_computed + len(tokens)) // block_size) + draw(st.integers(0, 2))
        table = draw(st.lists(st.integers(1, 500), min_size=num_blocks, max_size=num_blocks))
        chunks.append(SeqChunk(tokens, num_computed, table, draw(st.booleans())))
    return chunks, block_size


@settings(max_examples=examples(150), deadline=None)
@given(_chunks())
def test_builder_matches_per_token_reference(case: tuple[list[SeqChunk], int]) -> None:
    chunks, block_size = case
    b: ForwardBatch = build_forward_batch(chunks, block_size, "cpu", num_blocks=501)
    ref = _naive(chunks, block_size)
    assert b.input_ids.tolist() == ref["input_ids"]
    assert b.positions.tolist() == ref["positions"]
    assert b.slot_mapping.tolist() == ref["slot_mapping"]
    assert b.query_start_loc.tolist() == ref["qsl"]
    assert b.seq_lens.tolist() == ref["seq_lens"]
    assert b.logits_indices.tolist() == ref["logits_indices"]
    for row, c, seq_len in zip(b.block_tables.tolist(), chunks, ref["seq_lens"], strict=True):
        used = -(-seq_len // block_size)
        assert row[:used] == list(c.block_table[:used]) and set(row[used:]) <= {0}


@pytest.mark.parametrize(
    ("chunks", "kwargs", "match"),
    [
        ([], {}, "empty batch"),
        ([SeqChunk([], 0, [1])], {}, "chunk 0 has no tokens"),
        ([SeqChunk([1], 0, [1]), SeqChunk([1] * 5, 0, [2])], {}, "chunk 1: block table has 1"),
        ([SeqChunk([1], -1, [1])], {}, "negative"),
        ([SeqChunk([1, 2], 0, [0])], {"num_blocks": 8}, "chunk 0: a token's block is the null"),
        # A released (null) entry before the window is fine; one written to is not.
        ([SeqChunk([1], 4, [1, 0])], {"num_blocks": 8}, "chunk 0: a token's block is the null"),
        ([SeqChunk([1, 2], 0, [8])], {"num_blocks": 8}, "block id 8 outside"),
        ([SeqChunk([1, 2], 3, [1, 2])], {"max_model_len": 4}, "length 5 exceeds max_model_len=4"),
        ([SeqChunk([1, 99], 0, [1])], {"vocab_size": 99}, "token id 99 outside"),
    ],
)
def test_invalid_chunks_are_rejected_on_the_host_with_a_clear_message(
    chunks: list[SeqChunk], kwargs: dict[str, int], match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        build_forward_batch(chunks, 4, "cpu", **kwargs)


def test_a_batch_built_before_its_last_token_is_known_is_completed_in_place():
    """Async scheduling builds the next batch before the token it runs is sampled: setting
    that token afterwards gives exactly the batch built with it; a chunk whose sequence
    ended in between is made to write nothing, and nothing else changes."""
    builder = BatchBuilder(4, "cpu", num_blocks=16, max_model_len=64, vocab_size=100)
    known = [SeqChunk([7, 8, 9], 0, [3], False), SeqChunk([5], 6, [1, 2], True)]
    placeholder = [*known, SeqChunk([0], 9, [4, 5, 6], True), SeqChunk([0], 2, [7], True)]
    sampled = [*known, SeqChunk([42], 9, [4, 5, 6], True), SeqChunk([17], 2, [7], True)]
    host, want = builder.build_host(placeholder), builder.build_host(sampled)
    host.set_last_tokens([2, 3], [42, 17])
    assert np.array_equal(host.packed64, want.packed64)
    assert np.array_equal(host.packed32, want.packed32)

    host.write_nothing(1)
    batch = builder.upload(host)
    assert batch.slot_mapping.tolist() == [12, 13, 14, -1, 25, 30]
    assert batch.input_ids.tolist() == [7, 8, 9, 5, 42, 17]  # it still runs (logits ignored)
    padded = builder.build_host(placeholder[2:], pad_to_seqs=4, table_width=3)
    padded.set_last_tokens([1], [17])
    assert builder.upload(padded).input_ids.tolist() == [0, 17, 0, 0]


def test_null_entries_before_a_sliding_window_are_read_as_the_null_block():
    """A sliding-window pool releases the blocks out of the window: their entries are 0, and a
    chunk that writes only into live blocks builds."""
    batch = build_forward_batch([SeqChunk([7], 9, [0, 0, 5])], 4, "cpu", num_blocks=8)
    assert batch.block_tables.tolist() == [[0, 0, 5]]
    assert batch.slot_mapping.tolist() == [5 * 4 + 1]


def test_hybrid_tables_reach_each_group_and_steady_steps_rewrite_no_row() -> None:
    """A hybrid KV cache: every group's tables and slots in the batch; with more group tables
    than the row store starts with (3 x 100 > 256), a steady decode step writes no row."""
    groups, num_seqs, bs = 3, 100, 4
    builder = BatchBuilder(bs, "cpu", num_blocks=10_000, num_groups=groups)
    tables = [
        [[1 + 3000 * g + 30 * s + b for b in range(3)] for g in range(groups)]
        for s in range(num_seqs)
    ]
    chunks = [SeqChunk([5], 9, t[0], group_tables=t) for t in tables]
    batch = builder.build(chunks)
    assert batch.group_block_tables is not None and batch.group_slot_mapping is not None
    for g in range(groups):
        got_tables, got_slots = batch.tables_of(g)
        assert got_tables[7, :3].tolist() == tables[7][g]
        assert got_slots[7].item() == tables[7][g][2] * bs + 1  # position 9: block 2, offset 1
    writes = builder._tables.num_writes
    for _ in range(3):
        builder.build(chunks)
    assert builder._tables.num_writes == writes
