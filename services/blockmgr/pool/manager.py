"""One pool's block tables and the batched Step over them (pure logic, no I/O).

A pool serves one or more KV-cache groups, each with one table per sequence: full attention,
or a sliding window whose sequences give back the blocks out of the window (their table
entries become the null block 0; see :mod:`services.blockmgr.pool.groups`). Across the contract
a sequence's tables travel group-major, concatenated: they all have one entry per block of its
slots.

A Step is validated whole before anything changes: a malformed op, an unknown sequence, a
double free or a duplicate id rejects the Step with nothing applied. Capacity is then checked
per entry at apply time: an admission or a grow entry that does not fit gets
``RESOURCE_EXHAUSTED`` and changes nothing, and later ops on that sequence in the same step are
``SKIPPED`` (except Free, which always releases a live sequence).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from services.blockmgr.api.errors import BlockManagerError, ErrorCode, invalid, not_found
from services.blockmgr.api.types import (
    FULL_GROUP,
    Admit,
    AdmitResult,
    BlockCopy,
    Commit,
    CommitResult,
    EvictionPolicyName,
    Fork,
    ForkResult,
    Free,
    FreeResult,
    Grow,
    GrowResult,
    Operation,
    OpResult,
    OpStatus,
    PoolCounters,
    PoolSpec,
    RestoredSequence,
    SwapOut,
    Uncache,
    UncacheResult,
)
from services.blockmgr.eviction.retention import DEFAULT_RETENTION_STEPS
from services.blockmgr.pool.blocks import BlockPool
from services.blockmgr.pool.checks import (
    validate_step,
)
from services.blockmgr.pool.groups import group_key, longest_group_hit, windows_of
from services.blockmgr.pool.grow import grow
from services.blockmgr.pool.restore import restore
from services.blockmgr.pool.swap import swap_in, swap_out
from services.blockmgr.pool.tables import TableState
from services.blockmgr.tiers.host_tier import HostTier
from services.blockmgr.tiers.moves import (
    TierMoves,
    TierRun,
    take_moves,
    tier_lookup,
    tier_run,
)
from services.common.blocks import (
    NULL_BLOCK,
    blocks_for_tokens,
    needs_cow,
)

# In an admission's hits, a block found in a tier below the device (onboarded into a new one).
IN_TIER = -2  # (-1 is longest_window_hit's "not looked up yet")


class KVBlockManager:
    """The batched Step over one pool: its :class:`TableState` (the sequences' tables) over a
    :class:`BlockPool`. Admit, fork, free and commit are here; grow, swapping and restore in
    their own modules, over the table state.

    ``spec.groups``: the pool's KV-cache groups, validated (none: one full group).
    ``retention_steps``: how long a freed block keeps its retention priority
    (:mod:`services.blockmgr.eviction.retention`); ``clock``: the seconds session pins count
    (:mod:`services.blockmgr.eviction.pins`)."""

    def __init__(
        self,
        spec: PoolSpec,
        *,
        retention_steps: int = DEFAULT_RETENTION_STEPS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``spec`` as the core checked it (:meth:`BlockManagerCore.register`)."""
        groups = spec.groups
        if not groups:
            groups = (FULL_GROUP,)
        if spec.disk_blocks and not spec.host_blocks:
            raise invalid("disk_blocks: a disk tier needs a host tier above it (host_blocks)")
        self.spec = spec
        self.block_size = spec.block_size
        self.enable_prefix_caching = spec.enable_prefix_caching
        self.hit_margin = spec.prefix_hit_margin
        self.pool = BlockPool(
            spec.num_blocks,
            EvictionPolicyName.parse(spec.eviction_policy),
            retention_steps,
            spec.host_blocks,
            spec.disk_blocks,
            EvictionPolicyName.parse(spec.tier_eviction_policy),
            pin_budget=spec.pin_budget_blocks,
            clock=clock,
        )
        self.tables = TableState(
            self.pool, spec.block_size, windows_of(groups), spec.enable_prefix_caching
        )
        # (the tables' own structures, named here for the manager's readers)
        self.windows = self.tables.windows
        self.seqs = self.tables.seqs
        self.swapped = self.tables.swapped
        self.host_hits_tokens = 0
        self.disk_hits_tokens = 0
        self.prefix_queries_tokens = 0
        self.prefix_hits_tokens = 0

    @property
    def num_cow_copies(self) -> int:
        return self.tables.num_cow_copies

    # ---- counters -------------------------------------------------------------------------

    def counters(self) -> PoolCounters:
        pool = self.pool
        free = pool.num_free
        return PoolCounters(
            num_usable_blocks=pool.num_usable,
            num_free_blocks=free,
            num_cached_free_blocks=pool.num_cached_free,
            num_in_use_blocks=pool.num_usable - free,
            num_sequences=len(self.seqs),
        )

    def block_table(self, seq_id: int) -> list[int]:
        """The sequence's tables, group-major, concatenated (a one-group pool's one table)."""
        try:
            tables = self.seqs[seq_id].tables
        except KeyError:
            raise not_found(f"unknown seq_id {seq_id}") from None
        return [b for table in tables for b in table]

    # ---- Step -----------------------------------------------------------------------------

    def step(self, ops: Sequence[Operation]) -> list[OpResult]:
        validate_step(
            ops,
            self.seqs,
            self.tables.recently_freed,
            self.block_size,
            self.swapped,
            has_host=self.pool.host is not None,
            sizes=self.pool.sizes,
        )
        self.pool.tick()
        if self.pool.host is not None:
            self.pool.host.begin_step()
            if self.pool.disk is not None:
                self.pool.disk.begin_step()
        failed: set[int] = set()
        results: list[OpResult] = []
        for op in ops:
            if isinstance(op, Grow):
                results.append(self._grow(op, failed))
            elif isinstance(op, Free):
                results.append(self._free(op, failed))
            elif isinstance(op, Commit):
                results.append(self._commit(op, failed))
            elif isinstance(op, Admit):
                results.append(self._admit(op, failed))
            elif isinstance(op, Fork):
                results.append(self._fork(op, failed))
            elif isinstance(op, SwapOut):
                results.append(swap_out(self.tables, op, failed))
            elif isinstance(op, Uncache):
                results.append(UncacheResult(self.pool.uncache(op)))
            else:
                results.append(swap_in(self.tables, op, failed))
        return results

    # ---- operations -----------------------------------------------------------------------

    def _admit(self, op: Admit, failed: set[int]) -> AdmitResult:
        """The longest prefix hit every group serves (:func:`longest_group_hit`: a full group
        needs every block of it, a sliding group the blocks its window reads, the table null
        before them), on the device or in the tiers below it (those blocks are onboarded
        into new device blocks), then every group's table gets the same number of new
        blocks. The pool's ``prefix_hit_margin`` (EAGLE) stops the hit that many blocks short of
        that run: the hit is that of the shorter prefix, and the blocks dropped are new."""
        pool, bs = self.pool, self.block_size
        num_hit = 0
        lives = [0] * len(self.windows)
        # Per group: blocks live .. num_hit - 1, a device block or IN_TIER (onboarded from
        # ``run``, which lists them group after group, in table order).
        hits: list[list[int]] = [[] for _ in lives]
        run: TierRun = []
        if self.enable_prefix_caching:
            max_hits = (op.num_prompt_tokens - 1) // bs  # never cover the last prompt token
            if len(self.windows) > 1 or self.tables.any_sliding:
                num_hit, lives, hits, run = self._group_hit(op.block_hashes[:max_hits])
            else:  # one full group, the common case: the leading run of cached blocks
                found = hits[0]
                lookup = pool.lookup
                for block_hash in op.block_hashes[:max_hits]:
                    block_id = lookup(block_hash)
                    if block_id is None:
                        break
                    found.append(block_id)
                on_device = len(found)
                if pool.host is not None:  # the prefix may go on in the tiers below
                    run = tier_run(pool.host, pool.disk, op.block_hashes[on_device:max_hits])
                    found.extend([IN_TIER] * len(run))
                if self.hit_margin:  # the run's last blocks dropped: the tier run's ones first
                    del found[max(0, len(found) - self.hit_margin) :]
                    del run[max(0, len(found) - on_device) :]
                num_hit = len(found)
        num_cached = num_hit * bs
        num_tokens = num_cached + min(op.num_prompt_tokens - num_cached, op.max_new_tokens)
        need = blocks_for_tokens(num_tokens, bs) - num_hit
        refcount = pool.refcount
        revived = sum(1 for group in hits for b in group if b != IN_TIER and refcount[b] == 0)
        cost = need * len(self.windows) + len(run)
        if cost + op.reserve_blocks > pool.num_free - revived:
            failed.add(op.seq_id)
            return AdmitResult(OpStatus.RESOURCE_EXHAUSTED)
        priority, pin = op.retention_priority, op.pin_ttl_s
        # Every group's device hits are taken before any block is allocated: an allocation
        # may evict a cached free block, and that must not be a hit of a later group.
        for group_hits in hits:
            for block_id in group_hits:
                if block_id != IN_TIER:
                    pool.note_hit(block_id)
                    pool.incref(block_id)
                    if priority:
                        pool.retain(block_id, priority)
                    pool.pin(block_id, pin)
        filled = iter(self._onboard(run, priority, pin) if run else ())
        tables: list[list[int]] = []
        for live, group_hits in zip(lives, hits, strict=True):
            table = [NULL_BLOCK] * live
            table.extend(next(filled) if b == IN_TIER else b for b in group_hits)
            table.extend(pool.allocate() for _ in range(need))
            tables.append(table)
        self.tables.adopt(op.seq_id, tables, num_tokens, lives, priority, pin_ttl=pin)
        if self.enable_prefix_caching:  # counted once per admission, not per refused attempt
            self.prefix_queries_tokens += op.num_prompt_tokens
            self.prefix_hits_tokens += num_cached
        ids = tuple(tables[0]) if len(tables) == 1 else tuple(b for t in tables for b in t)
        return AdmitResult(OpStatus.OK, ids, num_cached, num_tokens)

    def _group_hit(
        self, block_hashes: Sequence[bytes]
    ) -> tuple[int, list[int], list[list[int]], TierRun]:
        """:func:`longest_group_hit` over the device and, with tiers, the tiers below it: a
        block found only there is IN_TIER in its group's hits and listed in the run. With a
        hit margin, the hit of the prefix that many blocks shorter (each key looked up once)."""
        pool, host = self.pool, self.pool.host
        below: dict[bytes, tuple[HostTier, int]] = {}
        seen: dict[bytes, int | None] = {}

        def lookup(key: bytes) -> int | None:
            if key in seen:  # (looked up in the first pass: a miss is told once)
                return seen[key]
            block_id = pool.lookup(key)
            where = tier_lookup(host, pool.disk, key) if block_id is None and host else None
            if where is not None:
                below[key] = where
                block_id = IN_TIER
            seen[key] = block_id
            return block_id

        windows, bs = self.windows, self.block_size
        num_hit, lives, hits = longest_group_hit(block_hashes, windows, bs, lookup)
        if self.hit_margin and num_hit:
            shorter = block_hashes[: max(0, num_hit - self.hit_margin)]
            num_hit, lives, hits = longest_group_hit(shorter, windows, bs, lookup)
        run: TierRun = []
        for group, (live, group_hits) in enumerate(zip(lives, hits, strict=True)):
            for i, block_id in enumerate(group_hits, start=live):
                if block_id == IN_TIER:
                    key = group_key(block_hashes[i], group)
                    run.append((key, *below[key]))
        return num_hit, lives, hits, run

    def _onboard(self, run: TierRun, priority: int, pin_ttl_s: float = 0.0) -> list[int]:
        blocks, from_disk = self.pool.fill_from_tiers(run, priority, pin_ttl_s)
        self.host_hits_tokens += (len(run) - from_disk) * self.block_size
        self.disk_hits_tokens += from_disk * self.block_size
        return blocks

    def take_moves(self) -> TierMoves:
        """The tiers' (offloads, onboards, spills, loads) of the Step just applied."""
        return take_moves(self.pool.host, self.pool.disk)

    def _grow(self, op: Grow, failed: set[int]) -> GrowResult:
        if len(self.windows) > 1 or self.tables.any_sliding:
            return grow(self.tables, op, failed)
        # One full group, the common case, kept lean: decode steps grow every sequence.
        pool, bs, seqs = self.pool, self.block_size, self.seqs
        statuses: list[OpStatus] = []
        new_ids: list[tuple[int, ...]] = []
        copies: list[BlockCopy] = []
        refcount = pool.refcount
        ok, empty = OpStatus.OK, ()
        lookahead = op.num_lookahead
        for entry, (seq_id, n) in enumerate(zip(op.seq_ids, op.num_tokens, strict=True)):
            if failed and seq_id in failed:
                statuses.append(OpStatus.SKIPPED)
                new_ids.append(empty)
                continue
            state = seqs[seq_id]
            table, old = state.tables[0], state.num_tokens
            new_total = old + n
            slots = new_total + lookahead[entry] if lookahead else new_total
            if slots < state.num_slots:
                slots = state.num_slots  # (a grow never gives slots back)
            need = -(-slots // bs) - len(table)
            # Writing into a shared, partially filled block (the one the first new token lands
            # in: the last one, unless the sequence holds lookahead slots) needs a private copy.
            at = old // bs
            cow = needs_cow(old, slots - old, bs, refcount[table[at]] if old % bs else 0)
            if need <= 0 and not cow:  # the common decode case: room left in the last block
                state.num_tokens = new_total
                state.num_slots = slots
                statuses.append(ok)
                new_ids.append(empty)
                continue
            need = max(need, 0)
            if need + cow > pool.num_free:
                failed.add(seq_id)
                statuses.append(OpStatus.RESOURCE_EXHAUSTED)
                new_ids.append(())
                continue
            added = self.tables.extend_table(table, entry, need, cow, copies, 0, at)
            state.num_tokens = new_total
            state.num_slots = slots
            statuses.append(OpStatus.OK)
            new_ids.append(added)
        return GrowResult(tuple(statuses), tuple(new_ids), tuple(copies))

    def _fork(self, op: Fork, failed: set[int]) -> ForkResult:
        if op.parent_seq_id in failed:
            failed.add(op.child_seq_id)
            return ForkResult(OpStatus.SKIPPED)
        parent = self.seqs[op.parent_seq_id]
        shared = 0
        # The blocks of the parent's tokens: its lookahead slots, if any, stay its own.
        held = blocks_for_tokens(parent.num_tokens, self.block_size)
        for table, live in zip(parent.tables, parent.first_lives, strict=True):
            for block_id in table[live:held]:  # null entries hold no reference
                self.pool.incref(block_id)
            shared += max(0, held - live)
        self.tables.adopt(
            op.child_seq_id,
            [t[:held] for t in parent.tables],
            parent.num_tokens,
            list(parent.first_lives),
            parent.priority,
            pin_ttl=parent.pin_ttl,
        )
        return ForkResult(OpStatus.OK, shared)

    def _free(self, op: Free, failed: set[int]) -> FreeResult:
        """Free applies to every live sequence, even one whose grow failed earlier in this
        step; only a sequence whose admission or fork failed (so never existed) is skipped."""
        return FreeResult(self.release(op.seq_ids))

    def release(self, seq_ids: Sequence[int]) -> int:
        """Free live or swapped-out sequences (a swap-out, offline replay); returns the
        device blocks freed."""
        return self.tables.release(seq_ids)

    def _commit(self, op: Commit, failed: set[int]) -> CommitResult:
        """Every group's blocks in the range are stored under their group's keys; an entry
        released out of the window (null) stores nothing."""
        if op.seq_id in failed:
            return CommitResult(OpStatus.SKIPPED)
        if not self.enable_prefix_caching:
            return CommitResult(OpStatus.OK, 0)
        stored = 0
        pool = self.pool
        state = self.seqs[op.seq_id]
        for group, table in enumerate(state.tables):
            for i, block_hash in enumerate(op.block_hashes, start=op.start_block):
                if table[i] != NULL_BLOCK:
                    stored += pool.store(table[i], group_key(block_hash, group))
                    if state.priority:
                        pool.retain(table[i], state.priority)
                    pool.pin(table[i], state.pin_ttl)
        return CommitResult(OpStatus.OK, stored)

    # ---- recovery -------------------------------------------------------------------------

    def restore(self, sequences: Sequence[RestoredSequence]) -> int:
        """Rebuild live (and swapped-out) sequences in an empty pool, after a block-manager
        restart (:func:`services.blockmgr.pool.restore.restore`)."""
        return restore(self.tables, sequences)


__all__ = ["BlockManagerError", "ErrorCode", "KVBlockManager"]
