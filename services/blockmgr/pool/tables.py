"""A pool's sequences and their block tables (pure logic, no I/O): the state that the Step's
operations (:mod:`.manager`), grow (:mod:`.grow`), swapping (:mod:`.swap`) and restore
(:mod:`.restore`) work on. They take this object, never the manager: the manager owns it and
dispatches to them.

A sequence has one table per KV-cache group, each with one entry per block of its
``num_slots`` slots: its ``num_tokens`` (verified) tokens, and speculative decoding's lookahead
slots beyond them, if any; in a sliding group the entries before ``first_lives[g]`` are
:data:`NULL_BLOCK` and hold no reference. A swapped-out sequence holds host slots instead.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from services.blockmgr.api.types import NO_SLOT, BlockCopy
from services.blockmgr.pool.blocks import BlockPool

__all__ = ["SeqState", "SwappedSeq", "TableState"]

_RECENTLY_FREED = 65536  # how many freed ids we remember to tell a double free from a typo


class SeqState:
    """A live sequence's tables, per group, and per group ``first_lives``: the entries before
    it are :data:`NULL_BLOCK` (always 0 in a full group)."""

    __slots__ = ("first_lives", "num_slots", "num_tokens", "pin_ttl", "priority", "tables")

    def __init__(
        self,
        tables: list[list[int]],
        num_tokens: int,
        first_lives: list[int],
        priority: int = 0,
        num_slots: int | None = None,
        pin_ttl: float = 0.0,
    ) -> None:
        self.tables = tables
        self.num_tokens = num_tokens
        self.num_slots = num_tokens if num_slots is None else num_slots  # >= num_tokens
        self.first_lives = first_lives
        self.priority = priority  # retention priority its hits and commits give their blocks
        self.pin_ttl = pin_ttl  # seconds its hits and commits pin their blocks once free

    @property
    def block_table(self) -> list[int]:
        """The first group's table (a one-group pool's only one)."""
        return self.tables[0]

    @property
    def first_live(self) -> int:
        """The first group's first live entry."""
        return self.first_lives[0]


class SwappedSeq:
    """A swapped-out sequence: the host slots of its tables, group-major (:data:`NO_SLOT` for
    a null entry), its tokens and its slots (>= its tokens: lookahead)."""

    __slots__ = ("num_slots", "num_tokens", "priority", "slots")

    def __init__(
        self, slots: list[int], num_tokens: int, priority: int = 0, num_slots: int | None = None
    ) -> None:
        self.slots = slots
        self.num_tokens = num_tokens
        self.num_slots = num_tokens if num_slots is None else num_slots
        self.priority = priority


class TableState:
    """Every sequence of one pool over its :class:`BlockPool`: live ones (``seqs``),
    swapped-out ones (``swapped``) and the ids freed lately (to tell a double free from a
    typo). ``windows``: per KV-cache group, its sliding window (0: full attention)."""

    def __init__(
        self, pool: BlockPool, block_size: int, windows: Sequence[int], enable_prefix_caching: bool
    ) -> None:
        self.pool = pool
        self.block_size = block_size
        self.windows = tuple(windows)
        self.num_groups = len(self.windows)
        self.any_sliding = any(self.windows)
        self.enable_prefix_caching = enable_prefix_caching
        self.seqs: dict[int, SeqState] = {}
        self.swapped: dict[int, SwappedSeq] = {}
        self.recently_freed: OrderedDict[int, None] = OrderedDict()
        self.num_cow_copies = 0

    def extend_table(
        self,
        table: list[int],
        entry: int,
        need: int,
        cow: bool,
        copies: list[BlockCopy],
        group: int = 0,
        cow_index: int = -1,
    ) -> tuple[int, ...]:
        """Grow entry ``entry``'s writes to ``table`` (of ``group``), which the pool has room
        for: a private copy of the shared block at ``cow_index`` (the last by default; the one
        the first new token lands in) when ``cow`` (recorded in ``copies``), then ``need`` new
        blocks appended. Returns the new blocks."""
        pool = self.pool
        if cow:
            index = cow_index % len(table)
            src = table[index]
            dst = pool.allocate()
            table[index] = dst
            pool.decref(src)
            copies.append(BlockCopy(entry, index, src, dst, group))
            self.num_cow_copies += 1
        added = tuple(pool.allocate() for _ in range(need)) if need > 0 else ()
        table.extend(added)
        return added

    def adopt(
        self,
        seq_id: int,
        tables: list[list[int]],
        num_tokens: int,
        first_lives: list[int],
        priority: int = 0,
        num_slots: int | None = None,
        pin_ttl: float = 0.0,
    ) -> None:
        """``seq_id`` (admitted, forked, swapped back in or restored) holds ``tables`` from now
        on (their references already taken)."""
        self.seqs[seq_id] = SeqState(tables, num_tokens, first_lives, priority, num_slots, pin_ttl)
        self.recently_freed.pop(seq_id, None)

    def release(self, seq_ids: Sequence[int]) -> int:
        """Free live or swapped-out sequences; returns the device blocks freed."""
        freed = 0
        for seq_id in seq_ids:
            if seq_id in self.seqs:
                freed += self._release(seq_id)
            elif seq_id in self.swapped:
                self._free_swapped(seq_id)
                self._forget(seq_id)
        return freed

    def _release(self, seq_id: int) -> int:
        """Group by group: a full group frees its table tail first, so a chain's tail is
        evicted before its head (the head is the most shareable part). A sliding group frees
        its live blocks oldest first, after the ones released out of the window earlier: the
        blocks a hit of the whole sequence needs (its last window) are evicted last."""
        state = self.seqs.pop(seq_id)
        freed = 0
        decref = self.pool.decref
        for table, live, window in zip(state.tables, state.first_lives, self.windows, strict=True):
            for block_id in table[live:] if window else reversed(table):
                freed += decref(block_id)
        self._forget(seq_id)
        return freed

    def _free_swapped(self, seq_id: int) -> None:
        """A swapped-out sequence is freed: its slots are given up."""
        host = self.pool.host
        assert host is not None
        for slot in self.swapped.pop(seq_id).slots:
            if slot != NO_SLOT:
                host.release_swapped(slot)

    def _forget(self, seq_id: int) -> None:
        self.recently_freed[seq_id] = None
        if len(self.recently_freed) > _RECENTLY_FREED:
            self.recently_freed.popitem(last=False)
