"""Restore: a pool rebuilt from its executor's view of its sequences, after a block-manager
restart (pure logic, no I/O)."""

from __future__ import annotations

from collections.abc import Sequence

from services.blockmgr.api.errors import invalid, precondition
from services.blockmgr.api.types import RestoredSequence
from services.blockmgr.pool.checks import MAX_TOKENS, check_block_ids, check_hashes, check_seq_id
from services.blockmgr.pool.groups import group_key
from services.blockmgr.pool.swap import check_swapped, restore_swapped
from services.blockmgr.pool.tables import TableState
from services.common.blocks import NULL_BLOCK, blocks_for_tokens, first_live_block

__all__ = ["restore"]


def restore(st: TableState, sequences: Sequence[RestoredSequence]) -> int:
    """Rebuild live sequences' tables in an empty pool (after a block-manager restart).
    All or nothing. Returns how many blocks became matchable.

    ``block_ids`` are the sequence's tables, group-major. A sliding group's table may
    start with a run of null entries (its first_live); the hashes of null entries are
    skipped. A block is in one group only: sequences may share it within that group."""
    if st.seqs or st.swapped:
        raise precondition(
            "restore needs a pool without live sequences; this one has "
            f"{len(st.seqs) + len(st.swapped)}"
        )
    check_swapped(st, sequences)
    bs, nb, num_groups = st.block_size, st.pool.num_blocks, st.num_groups
    seen: set[int] = set()
    group_of: dict[int, int] = {}
    parsed: list[tuple[list[list[int]], list[int]]] = []  # per sequence: tables, lives
    for i, seq in enumerate(sequences):
        where = f"sequences[{i}]"
        check_seq_id(seq.seq_id, f"{where}.seq_id")
        if seq.seq_id in seen:
            raise precondition(f"{where}.seq_id {seq.seq_id} appears twice")
        seen.add(seq.seq_id)
        if not 0 <= seq.num_tokens <= MAX_TOKENS:
            raise invalid(f"{where}.num_tokens must be >= 0")
        if not 0 <= seq.num_lookahead <= MAX_TOKENS:
            raise invalid(f"{where}.num_lookahead must be >= 0")
        if seq.host_slots:
            continue  # swapped out (check_swapped)
        n = blocks_for_tokens(seq.num_slots, bs)
        if len(seq.block_ids) != n * num_groups:
            raise invalid(
                f"{where}.block_ids: {seq.num_slots} token slots need {n} blocks in each of "
                f"{num_groups} group(s), got {len(seq.block_ids)}"
            )
        tables: list[list[int]] = []
        lives: list[int] = []
        for g in range(num_groups):
            table = list(seq.block_ids[g * n : (g + 1) * n])
            live = _restored_first_live(st, table, g, seq.num_tokens, f"{where}.block_ids")
            held = table[live:]
            check_block_ids(held, nb, f"{where}.block_ids", offset=g * n + live)
            if len(set(held)) != len(held):
                raise invalid(f"{where}.block_ids holds a block twice")
            for j, b in enumerate(held):
                if group_of.setdefault(b, g) != g:
                    raise invalid(
                        f"{where}.block_ids[{g * n + live + j}]: block {b} is in group "
                        f"{group_of[b]} elsewhere; a block serves one group"
                    )
            tables.append(table)
            lives.append(live)
        check_hashes(seq.block_hashes, f"{where}.block_hashes")
        if len(seq.block_hashes) > seq.num_tokens // bs:
            raise invalid(f"{where}.block_hashes: more hashes than full blocks")
        parsed.append((tables, lives))
    st.pool.take_free(set(group_of))
    restore_swapped(st, sequences)
    stored = 0
    refcount, store = st.pool.refcount, st.pool.store
    live_seqs = [s for s in sequences if not s.host_slots]
    for seq, (tables, lives) in zip(live_seqs, parsed, strict=True):
        for table, live in zip(tables, lives, strict=True):
            for block_id in table[live:]:
                refcount[block_id] += 1
        st.adopt(seq.seq_id, tables, seq.num_tokens, lives, num_slots=seq.num_slots)
        if st.enable_prefix_caching:
            for g, table in enumerate(tables):
                for block_id, block_hash in zip(table, seq.block_hashes, strict=False):
                    if block_id != NULL_BLOCK:
                        stored += store(block_id, group_key(block_hash, g))
    return stored


def _restored_first_live(
    st: TableState, table: list[int], group: int, num_tokens: int, where: str
) -> int:
    """The leading null entries of a restored sliding group's table (0 in a full group,
    where :func:`~.step_checks.check_block_ids` refuses any null entry). The last block
    must not be null, unless the window has already passed every block (W = 1 after a
    grow by 0)."""
    window = st.windows[group]
    if not window:
        return 0
    live = 0
    while live < len(table) and table[live] == NULL_BLOCK:
        live += 1
    window_start = first_live_block(num_tokens, window, st.block_size)
    if table and live == len(table) and live > window_start:
        offset = group * len(table)
        raise invalid(
            f"{where}[{offset + live - 1}]: block 0 is reserved; the last block of a table "
            "is still in the window and cannot be null"
        )
    return live
