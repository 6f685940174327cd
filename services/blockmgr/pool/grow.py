"""Grow in a pool of several KV-cache groups or a sliding one (pure logic, no I/O): each
entry first releases what left its sliding windows, then every group's table grows alike."""

from __future__ import annotations

from services.blockmgr.api.types import BlockCopy, Grow, GrowResult, OpStatus
from services.blockmgr.pool.tables import TableState
from services.common.blocks import NULL_BLOCK, first_live_block, slots_after_grow

__all__ = ["grow"]


def grow(st: TableState, op: Grow, failed: set[int]) -> GrowResult:
    """A Grow in a pool with more than one group or a sliding one. Each entry first releases, in
    every SLIDING group, the blocks before the window of its queries (they start at the sequence's
    current slot count): their entries become 0 and they are decref'd in order, so a block nobody
    else holds is freed (committed: cached-free and matchable) and counts for this entry's
    allocations. Then every group's table grows by the same number of blocks (group-major in
    ``new_block_ids``), after a private copy of a shared, partly filled last block where needed. A
    failed or skipped entry releases nothing. In pools with a sliding group, ``first_live_blocks``
    reports each entry's first_live per group (entry-major). Lookahead slots (``num_lookahead``)
    are held beyond the tokens; the windows release by the tokens (verified) only."""
    pool, bs, windows, seqs = st.pool, st.block_size, st.windows, st.seqs
    sliding = st.any_sliding
    refcount = pool.refcount
    statuses: list[OpStatus] = []
    new_ids: list[tuple[int, ...]] = []
    copies: list[BlockCopy] = []
    first_lives: list[int] = []
    ok, empty = OpStatus.OK, ()
    lookahead = op.num_lookahead
    for entry, (seq_id, n) in enumerate(zip(op.seq_ids, op.num_tokens, strict=True)):
        if failed and seq_id in failed:  # absent if its admission failed in this step
            statuses.append(OpStatus.SKIPPED)
            new_ids.append(empty)
            if sliding:
                skipped = seqs.get(seq_id)
                first_lives.extend(skipped.first_lives if skipped else [0] * len(windows))
            continue
        state = seqs[seq_id]
        tables, old, starts = state.tables, state.num_tokens, state.first_lives
        slots = slots_after_grow(old, state.num_slots, n, lookahead[entry] if lookahead else 0)
        need = max(0, -(-slots // bs) - len(tables[0]))
        # Writing into a shared, partially filled block (the one the first new token lands
        # in) needs a private copy first; it is never a released one (a block is released only
        # when full, W = 1).
        at = old // bs
        writes = slots > old
        cows = [refcount[t[at]] > 1 for t in tables] if writes and old % bs else None
        lives = (
            [max(first_live_block(old, w, bs), s) for w, s in zip(windows, starts, strict=True)]
            if sliding
            else starts
        )
        if not need and not (cows and any(cows)) and lives == starts:
            state.num_tokens = old + n  # the common decode case: room left in the last block
            state.num_slots = slots
            statuses.append(ok)
            new_ids.append(empty)
            if sliding:
                first_lives.extend(starts)
            continue
        cost = need * len(tables) + (sum(cows) if cows else 0)
        if cost:
            freed_here = sum(
                1
                for t, s, live in zip(tables, starts, lives, strict=True)
                for i in range(s, live)
                if refcount[t[i]] == 1
            )
            if cost > pool.num_free + freed_here:
                failed.add(seq_id)
                statuses.append(OpStatus.RESOURCE_EXHAUSTED)
                new_ids.append(empty)
                if sliding:
                    first_lives.extend(starts)
                continue
        if lives is not starts:
            for t, s, live in zip(tables, starts, lives, strict=True):
                for i in range(s, live):  # oldest first: evicted first
                    pool.decref(t[i])
                    t[i] = NULL_BLOCK
            state.first_lives = lives
        added: tuple[int, ...] = ()
        for g, table in enumerate(tables):
            added += st.extend_table(table, entry, need, bool(cows and cows[g]), copies, g, at)
        state.num_tokens = old + n
        state.num_slots = slots
        statuses.append(ok)
        new_ids.append(added)
        if sliding:
            first_lives.extend(lives)
    return GrowResult(tuple(statuses), tuple(new_ids), tuple(copies), tuple(first_lives))
