"""One pool's block tables and the batched Step over them (pure logic, no I/O).

A pool serves one KV-cache group: full attention, or a sliding window whose sequences give back
the blocks out of the window (their table entries become the null block 0; see
:mod:`services.blockmgr.kv_groups`).

A Step is validated whole before anything changes: a malformed op, an unknown sequence, a
double free or a duplicate id rejects the Step with nothing applied. Capacity is then checked
per entry at apply time: an admission or a grow entry that does not fit gets
``RESOURCE_EXHAUSTED`` and changes nothing, and later ops on that sequence in the same step are
``SKIPPED`` (except Free, which always releases a live sequence).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

from services.blockmgr.errors import BlockManagerError, ErrorCode, invalid, not_found, precondition
from services.blockmgr.hashing import HASH_SIZE
from services.blockmgr.kv_groups import grow_sliding, longest_window_hit
from services.blockmgr.pool import BlockPool
from services.blockmgr.types import (
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
    RestoredSequence,
)
from services.common.blocks import (
    NULL_BLOCK,
    blocks_for_tokens,
    blocks_to_grow,
    first_live_block,
    full_blocks,
    needs_cow,
)

MAX_SEQ_ID = 2**64 - 1
MAX_TOKENS = 2**40
_RECENTLY_FREED = 65536  # how many freed ids we remember to tell a double free from a typo


class SeqState:
    """A sequence's table (one entry per block of its ``num_tokens`` slots) and, in a sliding
    pool, ``first_live``: the entries before it are :data:`NULL_BLOCK` (0 in full pools)."""

    __slots__ = ("block_table", "first_live", "num_tokens")

    def __init__(self, block_table: list[int], num_tokens: int, first_live: int = 0) -> None:
        self.block_table = block_table
        self.num_tokens = num_tokens
        self.first_live = first_live


class KVBlockManager:
    """Block tables of one pool's sequences over a :class:`BlockPool`.

    ``sliding_window``: W tokens for a sliding-window pool (a query at p reads the keys in
    (p - W, p]), 0 for full attention."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        enable_prefix_caching: bool = True,
        eviction_policy: EvictionPolicyName = EvictionPolicyName.LRU,
        sliding_window: int = 0,
    ) -> None:
        self.block_size = block_size
        self.sliding_window = sliding_window
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, eviction_policy)
        self.seqs: dict[int, SeqState] = {}
        self._recently_freed: OrderedDict[int, None] = OrderedDict()
        self.prefix_queries_tokens = 0
        self.prefix_hits_tokens = 0
        self.num_cow_copies = 0

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
        try:
            return list(self.seqs[seq_id].block_table)
        except KeyError:
            raise not_found(f"unknown seq_id {seq_id}") from None

    # ---- Step -----------------------------------------------------------------------------

    def step(self, ops: Sequence[Operation]) -> list[OpResult]:
        self._validate(ops)
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
            else:
                results.append(self._fork(op, failed))
        return results

    def _validate(self, ops: Sequence[Operation]) -> None:
        """Reject the whole step on any malformed op, simulating liveness and token counts in
        order as if every entry succeeded (a capacity failure only ever removes effects)."""
        overlay: dict[int, int | None] = {}  # seq_id -> simulated num_tokens, None = freed
        seqs = self.seqs

        def tokens_of(seq_id: int, where: str) -> int:
            if seq_id in overlay:
                n = overlay[seq_id]
                if n is None:
                    raise precondition(f"{where}: seq_id {seq_id} was freed earlier in this step")
                return n
            state = seqs.get(seq_id)
            if state is None:
                if seq_id in self._recently_freed:
                    raise precondition(f"{where}: seq_id {seq_id} was already freed")
                raise not_found(f"{where}: unknown seq_id {seq_id}")
            return state.num_tokens

        def absent(seq_id: int, where: str) -> None:
            _check_seq_id(seq_id, where)
            live = overlay[seq_id] is not None if seq_id in overlay else seq_id in seqs
            if live:
                raise precondition(f"{where}: seq_id {seq_id} already exists")

        for i, op in enumerate(ops):
            where = f"ops[{i}]"
            if isinstance(op, Grow):
                if len(op.seq_ids) != len(op.num_tokens):
                    raise invalid(f"{where}.grow: seq_ids and num_tokens differ in length")
                if len(set(op.seq_ids)) != len(op.seq_ids):
                    dup = next(x for j, x in enumerate(op.seq_ids) if x in op.seq_ids[:j])
                    raise invalid(f"{where}.grow.seq_ids: seq_id {dup} is listed twice")
                for j, (seq_id, n) in enumerate(zip(op.seq_ids, op.num_tokens, strict=True)):
                    if not 0 <= n <= MAX_TOKENS:
                        raise invalid(f"{where}.grow.num_tokens[{j}] must be >= 0, got {n}")
                    state = seqs.get(seq_id)  # fast path: a live sequence untouched so far
                    if state is not None and seq_id not in overlay:
                        overlay[seq_id] = state.num_tokens + n
                    else:
                        overlay[seq_id] = tokens_of(seq_id, f"{where}.grow.seq_ids[{j}]") + n
            elif isinstance(op, Free):
                for j, seq_id in enumerate(op.seq_ids):
                    tokens_of(seq_id, f"{where}.free.seq_ids[{j}]")
                    overlay[seq_id] = None
            elif isinstance(op, Commit):
                n = tokens_of(op.seq_id, f"{where}.commit.seq_id")
                _check_hashes(op.block_hashes, f"{where}.commit.block_hashes")
                if op.start_block < 0:
                    raise invalid(f"{where}.commit.start_block must be >= 0")
                full = full_blocks(n, self.block_size)
                if op.start_block + len(op.block_hashes) > full:
                    raise invalid(
                        f"{where}.commit: blocks {op.start_block}.."
                        f"{op.start_block + len(op.block_hashes) - 1} are not all full "
                        f"(seq_id {op.seq_id} has {full} full blocks)"
                    )
            elif isinstance(op, Admit):
                absent(op.seq_id, f"{where}.admit.seq_id")
                if not 1 <= op.num_prompt_tokens <= MAX_TOKENS:
                    raise invalid(f"{where}.admit.num_prompt_tokens must be >= 1")
                if not 1 <= op.max_new_tokens <= MAX_TOKENS:
                    raise invalid(f"{where}.admit.max_new_tokens must be >= 1")
                if op.reserve_blocks < 0:
                    raise invalid(f"{where}.admit.reserve_blocks must be >= 0")
                _check_hashes(op.block_hashes, f"{where}.admit.block_hashes")
                if len(set(op.block_hashes)) != len(op.block_hashes):
                    # A chained hash never repeats within one prompt; a repeat would put one
                    # block twice in a table (refcount != tables holding it).
                    raise invalid(f"{where}.admit.block_hashes: a hash is listed twice")
                if len(op.block_hashes) > full_blocks(op.num_prompt_tokens, self.block_size):
                    raise invalid(
                        f"{where}.admit.block_hashes: {len(op.block_hashes)} hashes for "
                        f"{full_blocks(op.num_prompt_tokens, self.block_size)} full prompt blocks"
                    )
                # The hit length is only known at apply time; min(P, M) is the fewest slots a
                # successful admission holds, so later commits are checked against that.
                overlay[op.seq_id] = min(op.num_prompt_tokens, op.max_new_tokens)
            elif isinstance(op, Fork):
                n = tokens_of(op.parent_seq_id, f"{where}.fork.parent_seq_id")
                absent(op.child_seq_id, f"{where}.fork.child_seq_id")
                overlay[op.child_seq_id] = n
            else:
                raise invalid(f"{where}: unknown operation {type(op).__name__}")

    # ---- operations -----------------------------------------------------------------------

    def _admit(self, op: Admit, failed: set[int]) -> AdmitResult:
        """Full pools: the longest run of matchable blocks from the first. Sliding pools: the
        longest hit of ``k`` blocks whose window blocks (those a query at ``k * bs`` reads) are
        matchable; the table is null before them."""
        pool, bs, window = self.pool, self.block_size, self.sliding_window
        hits: list[int] = []  # the referenced cached blocks: indices live .. num_hit - 1
        num_hit = 0
        if self.enable_prefix_caching:
            max_hits = (op.num_prompt_tokens - 1) // bs  # never cover the last prompt token
            if window:
                num_hit, hits = longest_window_hit(
                    op.block_hashes[:max_hits], window, bs, pool.lookup
                )
            else:
                for block_hash in op.block_hashes[:max_hits]:
                    block_id = pool.lookup(block_hash)
                    if block_id is None:
                        break
                    hits.append(block_id)
                num_hit = len(hits)
        num_cached = num_hit * bs
        live = num_hit - len(hits)  # first_live: the queries start at num_cached
        num_tokens = num_cached + min(op.num_prompt_tokens - num_cached, op.max_new_tokens)
        need = blocks_for_tokens(num_tokens, bs) - num_hit
        revived = sum(1 for b in hits if pool.refcount[b] == 0)
        if need + op.reserve_blocks > pool.num_free - revived:
            failed.add(op.seq_id)
            return AdmitResult(OpStatus.RESOURCE_EXHAUSTED)
        for block_id in hits:
            pool.note_hit(block_id)
            pool.incref(block_id)
        table = [NULL_BLOCK] * live + hits if live else hits
        table.extend(pool.allocate() for _ in range(need))
        self.seqs[op.seq_id] = SeqState(table, num_tokens, live)
        self._recently_freed.pop(op.seq_id, None)
        if self.enable_prefix_caching:  # counted once per admission, not per refused attempt
            self.prefix_queries_tokens += op.num_prompt_tokens
            self.prefix_hits_tokens += num_cached
        return AdmitResult(OpStatus.OK, tuple(table), num_cached, num_tokens)

    def _grow(self, op: Grow, failed: set[int]) -> GrowResult:
        if self.sliding_window:
            return grow_sliding(self, op, failed)
        pool, bs, seqs = self.pool, self.block_size, self.seqs
        statuses: list[OpStatus] = []
        new_ids: list[tuple[int, ...]] = []
        copies: list[BlockCopy] = []
        refcount = pool.refcount
        ok, empty = OpStatus.OK, ()
        for entry, (seq_id, n) in enumerate(zip(op.seq_ids, op.num_tokens, strict=True)):
            if failed and seq_id in failed:
                statuses.append(OpStatus.SKIPPED)
                new_ids.append(empty)
                continue
            state = seqs[seq_id]
            table, old = state.block_table, state.num_tokens
            new_total = old + n
            need = blocks_to_grow(old, n, len(table), bs)
            # Writing into a shared, partially filled last block needs a private copy first.
            cow = needs_cow(old, n, bs, refcount[table[-1]] if table else 0)
            if not need and not cow:  # the common decode case: room left in the last block
                state.num_tokens = new_total
                statuses.append(ok)
                new_ids.append(empty)
                continue
            if need + cow > pool.num_free:
                failed.add(seq_id)
                statuses.append(OpStatus.RESOURCE_EXHAUSTED)
                new_ids.append(())
                continue
            added = self.extend_table(table, entry, need, cow, copies)
            state.num_tokens = new_total
            statuses.append(OpStatus.OK)
            new_ids.append(added)
        return GrowResult(tuple(statuses), tuple(new_ids), tuple(copies))

    def extend_table(
        self, table: list[int], entry: int, need: int, cow: bool, copies: list[BlockCopy]
    ) -> tuple[int, ...]:
        """Grow entry ``entry``'s writes to ``table``, which the pool has room for: a private
        copy of the shared last block when ``cow`` (recorded in ``copies``), then ``need``
        new blocks appended. Returns the new blocks."""
        pool = self.pool
        if cow:
            src = table[-1]
            dst = pool.allocate()
            table[-1] = dst
            pool.decref(src)
            copies.append(BlockCopy(entry, len(table) - 1, src, dst))
            self.num_cow_copies += 1
        added = tuple(pool.allocate() for _ in range(need)) if need > 0 else ()
        table.extend(added)
        return added

    def _fork(self, op: Fork, failed: set[int]) -> ForkResult:
        if op.parent_seq_id in failed:
            failed.add(op.child_seq_id)
            return ForkResult(OpStatus.SKIPPED)
        parent = self.seqs[op.parent_seq_id]
        live = parent.first_live
        for block_id in parent.block_table[live:]:  # null entries hold no reference
            self.pool.incref(block_id)
        self.seqs[op.child_seq_id] = SeqState(list(parent.block_table), parent.num_tokens, live)
        self._recently_freed.pop(op.child_seq_id, None)
        return ForkResult(OpStatus.OK, len(parent.block_table) - live)

    def _free(self, op: Free, failed: set[int]) -> FreeResult:
        """Free applies to every live sequence, even one whose grow failed earlier in this
        step; only a sequence whose admission or fork failed (so never existed) is skipped."""
        freed = 0
        for seq_id in op.seq_ids:
            if seq_id in self.seqs:
                freed += self._release(seq_id)
        return FreeResult(freed)

    def _release(self, seq_id: int) -> int:
        """Full pools free a table tail first, so a chain's tail is evicted before its head
        (the head is the most shareable part). Sliding pools free the live blocks oldest first,
        after the ones released out of the window earlier: the blocks a hit of the whole
        sequence needs (its last window) are evicted last."""
        state = self.seqs.pop(seq_id)
        freed = 0
        table = state.block_table
        blocks = table[state.first_live :] if self.sliding_window else reversed(table)
        for block_id in blocks:
            freed += self.pool.decref(block_id)
        self._recently_freed[seq_id] = None
        if len(self._recently_freed) > _RECENTLY_FREED:
            self._recently_freed.popitem(last=False)
        return freed

    def _commit(self, op: Commit, failed: set[int]) -> CommitResult:
        if op.seq_id in failed:
            return CommitResult(OpStatus.SKIPPED)
        if not self.enable_prefix_caching:
            return CommitResult(OpStatus.OK, 0)
        table = self.seqs[op.seq_id].block_table
        stored = 0
        for i, block_hash in enumerate(op.block_hashes, start=op.start_block):
            if table[i] != NULL_BLOCK:  # released out of the window: nothing to store
                stored += self.pool.store(table[i], block_hash)
        return CommitResult(OpStatus.OK, stored)

    # ---- recovery -------------------------------------------------------------------------

    def restore(self, sequences: Sequence[RestoredSequence]) -> int:
        """Rebuild live sequences' tables in an empty pool (after a block-manager restart).
        All or nothing. Returns how many blocks became matchable.

        In a sliding pool a table may start with a run of null entries (its first_live); the
        hashes of null entries are skipped."""
        if self.seqs:
            raise precondition(
                f"restore needs a pool without live sequences; this one has {len(self.seqs)}"
            )
        bs, nb = self.block_size, self.pool.num_blocks
        seen: set[int] = set()
        used: set[int] = set()
        lives: list[int] = []  # per sequence: its leading null entries
        for i, seq in enumerate(sequences):
            where = f"sequences[{i}]"
            _check_seq_id(seq.seq_id, f"{where}.seq_id")
            if seq.seq_id in seen:
                raise precondition(f"{where}.seq_id {seq.seq_id} appears twice")
            seen.add(seq.seq_id)
            if not 0 <= seq.num_tokens <= MAX_TOKENS:
                raise invalid(f"{where}.num_tokens must be >= 0")
            if len(seq.block_ids) != blocks_for_tokens(seq.num_tokens, bs):
                raise invalid(
                    f"{where}.block_ids: {seq.num_tokens} tokens need "
                    f"{blocks_for_tokens(seq.num_tokens, bs)} blocks, got {len(seq.block_ids)}"
                )
            live = self._restored_first_live(seq, f"{where}.block_ids")
            held = seq.block_ids[live:]
            _check_block_ids(held, nb, f"{where}.block_ids", offset=live)
            if len(set(held)) != len(held):
                raise invalid(f"{where}.block_ids holds a block twice")
            _check_hashes(seq.block_hashes, f"{where}.block_hashes")
            if len(seq.block_hashes) > seq.num_tokens // bs:
                raise invalid(f"{where}.block_hashes: more hashes than full blocks")
            used.update(held)
            lives.append(live)
        self.pool.take_free(used)
        stored = 0
        for seq, live in zip(sequences, lives, strict=True):
            for block_id in seq.block_ids[live:]:
                self.pool.refcount[block_id] += 1
            self.seqs[seq.seq_id] = SeqState(list(seq.block_ids), seq.num_tokens, live)
            if self.enable_prefix_caching:
                for block_id, block_hash in zip(seq.block_ids, seq.block_hashes, strict=False):
                    if block_id != NULL_BLOCK:
                        stored += self.pool.store(block_id, block_hash)
        return stored

    def _restored_first_live(self, seq: RestoredSequence, where: str) -> int:
        """The leading null entries of a restored sliding-window table (0 in full pools, where
        :func:`_check_block_ids` refuses any null entry). The last block must not be null,
        unless the window has already passed every block (W = 1 after a grow by 0)."""
        if not self.sliding_window:
            return 0
        ids = seq.block_ids
        live = 0
        while live < len(ids) and ids[live] == NULL_BLOCK:
            live += 1
        window_start = first_live_block(seq.num_tokens, self.sliding_window, self.block_size)
        if ids and live == len(ids) and live > window_start:
            raise invalid(
                f"{where}[{live - 1}]: block 0 is reserved; the last block of a table is "
                "still in the window and cannot be null"
            )
        return live


def _check_seq_id(seq_id: int, where: str) -> None:
    if not 0 <= seq_id <= MAX_SEQ_ID:
        raise invalid(f"{where} must be a uint64, got {seq_id}")


def _check_hashes(hashes: Iterable[bytes], where: str) -> None:
    for j, h in enumerate(hashes):
        if len(h) != HASH_SIZE:
            raise invalid(f"{where}[{j}] must be {HASH_SIZE} bytes, got {len(h)}")


def _check_block_ids(
    block_ids: Iterable[int], num_blocks: int, where: str, *, offset: int = 0
) -> None:
    for j, b in enumerate(block_ids, start=offset):
        if b == NULL_BLOCK:
            raise invalid(
                f"{where}[{j}]: block 0 is reserved (null entries may only lead the table of "
                "a sliding-window pool)"
            )
        if not 0 < b < num_blocks:
            raise invalid(f"{where}[{j}] = {b} is out of range [1, {num_blocks})")


__all__ = ["BlockManagerError", "ErrorCode", "KVBlockManager"]
