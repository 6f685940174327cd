"""The host mirror of the block tables: rows kept across steps, updated by appends only.

Every test here runs the mirror with its checker off (``verify=False``), so that what is
tested is the mechanism itself, not the suite-wide check that guards its contract.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.executor.model.forward_batch import BatchBuilder, SeqChunk
from services.executor.model.host_block_tables import VERIFY_ENV, HostBlockTables
from tests.hypothesis_budget import examples


def _rows(store: HostBlockTables, tables: list[list[int]]) -> list[list[int]]:
    rows = store.rows(tables, np.fromiter(map(len, tables), np.int64, len(tables)))
    return [store.ids[r].tolist() for r in rows.tolist()]


def _padded(table: list[int], width: int) -> list[int]:
    return [*table, *[0] * (width - len(table))]


# One step of a random life: per table, append blocks in place, replace it by a new list
# with its last block changed (copy-on-write), or start a new table; then build a batch of
# some of the tables, maybe one twice.
_STEP = st.tuples(
    st.lists(st.sampled_from(["keep", "append", "append2", "cow", "new"]), min_size=6, max_size=6),
    st.lists(st.integers(0, 5), min_size=1, max_size=7),
)


@settings(max_examples=examples(120), deadline=None)
@given(steps=st.lists(_STEP, min_size=1, max_size=25), num_rows=st.integers(1, 3))
def test_rows_always_equal_their_tables_through_appends_replacements_and_evictions(
    steps: list[tuple[list[str], list[int]]], num_rows: int
) -> None:
    store = HostBlockTables(num_blocks=10_000, num_rows=num_rows, width=1, verify=False)
    tables: list[list[int]] = [[1 + i] for i in range(6)]
    next_id = 100
    for actions, picks in steps:
        for i, action in enumerate(actions):
            if action in ("append", "append2"):
                for _ in range(1 if action == "append" else 2):
                    tables[i].append(next_id)
                    next_id += 1
            elif action == "cow" and tables[i]:
                tables[i] = [*tables[i][:-1], next_id]
                next_id += 1
            elif action == "new":
                tables[i] = [next_id]
                next_id += 1
        batch = [tables[p] for p in picks]
        got = _rows(store, batch)
        assert got == [_padded(t, store.width) for t in batch]
    # Capacity only grows when one batch needs more rows than exist.
    assert store.ids.shape[0] <= max(num_rows, 8)


def test_a_steady_decode_writes_only_the_appended_blocks():
    store = HostBlockTables(num_blocks=1000, verify=False)
    tables = [[1 + i] for i in range(8)]
    _rows(store, tables)
    assert store.num_writes == 8  # each table written once, in full
    for _ in range(5):
        assert _rows(store, tables) == [_padded(t, store.width) for t in tables]
    assert store.num_writes == 8  # nothing changed, nothing written
    tables[3].append(500)
    tables[5].append(501)
    assert _rows(store, tables)[3][:2] == [4, 500]
    assert store.num_writes == 10  # only the two grown rows


def test_an_edit_in_place_is_caught_by_the_checker_and_missed_without_it():
    """The contract the mirror rests on: a table passed again as the same object was only
    appended to. The suite runs with the checker on, so a violation fails loudly."""
    table = [1, 2, 3]
    checked = HostBlockTables(verify=True)
    unchecked = HostBlockTables(verify=False)
    _rows(checked, [table])
    _rows(unchecked, [table])
    table[-1] = 9  # copy-on-write done wrong: in place
    with pytest.raises(AssertionError, match="stale"):
        _rows(checked, [table])
    assert _rows(unchecked, [table])[0][:3] == [1, 2, 3]  # why the contract matters


def test_a_bad_block_id_names_its_chunk_and_leaves_the_rows_consistent():
    store = HostBlockTables(num_blocks=50, verify=False)
    good, bad = [1, 2], [3]
    _rows(store, [good, bad])
    bad.append(50)
    with pytest.raises(ValueError, match="chunk 1: block id 50 outside"):
        _rows(store, [good, bad])
    bad[-1] = 7  # (a new list would be the contract; the row was never written with 50)
    good.append(4)
    assert _rows(store, [good, bad]) == [_padded([1, 2, 4], store.width), _padded([3, 7], 32)]


def test_a_builder_reused_across_steps_builds_what_a_fresh_builder_builds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Many steps of one builder (mirrored tables) against a new builder each step."""
    monkeypatch.delenv(VERIFY_ENV, raising=False)
    rng = np.random.default_rng(3)
    bs = 4
    mirrored = BatchBuilder(bs, "cpu", num_blocks=4096)
    seqs = [([1 + i], 3 * i, [1 + i]) for i in range(5)]  # (tokens, computed, table)
    next_block = 10
    for _ in range(60):
        chunks = []
        for j, (_, computed, table) in enumerate(seqs):
            k = int(rng.integers(1, 6))
            while -(-(computed + k) // bs) > len(table):
                table.append(next_block)
                next_block += 1
            if rng.random() < 0.1:  # copy-on-write of the last block: a new list
                table = [*table[:-1], next_block]
                next_block += 1
            tokens = rng.integers(0, 100, k).tolist()
            seqs[j] = (tokens, computed, table)
            chunks.append(SeqChunk(tokens, computed, table, bool(rng.random() < 0.8)))
        picked = [chunks[i] for i in rng.permutation(len(chunks))[: int(rng.integers(1, 6))]]
        want = BatchBuilder(bs, "cpu", num_blocks=4096).build_host(picked)
        got = mirrored.build_host(picked)
        assert np.array_equal(got.packed64, want.packed64)
        assert np.array_equal(got.packed32, want.packed32)
        seqs = [(t, c + len(t), tab) for t, c, tab in seqs]
