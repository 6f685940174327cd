"""The host copy of the block tables a batch builder has seen, updated by appends.

A decode step of 256 sequences used to flatten every block table (about 10,000 Python ints)
into the batch. The tables barely change between steps: a sequence gains one block every
``block_size`` tokens. So each table lives in a row of one persistent int32 array, and a
build only writes what was appended since that row was last synced, then gathers the rows
it needs with one numpy take (vLLM's ``BlockTable`` keeps its CPU rows the same way).

A table is recognised by identity: the row keeps a reference to the list it mirrors, so an
``id()`` cannot be reused while the row exists. This rests on one contract, stated on
:class:`~.forward_batch.SeqChunk`: **a block table passed again as the same object has only
been appended to**; any other change (copy-on-write of a block, a table rebuilt after
preemption) comes as a new list. The scheduler keeps it. ``PAGEDSERVE_VERIFY_BLOCK_TABLES=1``
(set for the whole test suite) checks every gathered row against its table.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np

__all__ = ["HostBlockTables"]

VERIFY_ENV = "PAGEDSERVE_VERIFY_BLOCK_TABLES"


class HostBlockTables:
    """Rows of block ids, one per table seen recently, zero past each table's length.

    Rows are never freed explicitly (the builder does not know when a sequence ends): when
    none is free, every row not used by the build in progress is dropped, and a table seen
    again later is written again in full. Capacity and width double as needed.
    """

    def __init__(
        self,
        *,
        num_blocks: int | None = None,
        num_rows: int = 256,
        width: int = 32,
        verify: bool | None = None,
    ) -> None:
        self.num_blocks = num_blocks
        self.verify = os.environ.get(VERIFY_ENV) == "1" if verify is None else verify
        self.ids = np.zeros((num_rows, width), np.int32)  # the rows
        self._lens = np.zeros(num_rows, np.int64)  # blocks synced per row
        self._stamp = np.zeros(num_rows, np.int64)  # last build that used the row
        self._owner: list[Sequence[int] | None] = [None] * num_rows
        self._row_of: dict[int, int] = {}  # id(table) -> row
        self._free = list(range(num_rows - 1, -1, -1))
        self._build = 0
        self.num_writes = 0  # rows (re)written in full or in part, for tests and benchmarks

    @property
    def width(self) -> int:
        return self.ids.shape[1]

    def rows(self, tables: Sequence[Sequence[int]], lens: np.ndarray) -> np.ndarray:
        """The row of each of ``tables`` (whose lengths are ``lens``), synced with it.

        Raises ``ValueError`` naming the table for a block id outside ``[0, num_blocks)`` (0,
        the null block, stands for a block released out of a sliding window);
        rows written before the error stay consistent."""
        self._build += 1
        found = list(map(self._row_of.get, map(id, tables)))
        if None in found:
            known = [r for r in found if r is not None]
            self._stamp[known] = self._build  # not to be dropped by the rows added now
            for i, row in enumerate(found):
                if row is None:  # (looked up again: a table may come twice in one batch)
                    row = self._row_of.get(id(tables[i]))
                    found[i] = self._add(tables[i], i) if row is None else row
        rows = np.array(found, np.intp)
        synced = self._lens[rows]
        stale = np.flatnonzero(synced != lens)
        if stale.size:
            self._sync_stale(rows, tables, lens, synced, stale)
        if self.verify:
            self._check(rows, tables)
        return rows

    def _sync_stale(
        self,
        rows: np.ndarray,
        tables: Sequence[Sequence[int]],
        lens: np.ndarray,
        synced: np.ndarray,
        stale: np.ndarray,
    ) -> None:
        """Sync the ``stale`` entries: when each gained one block (the usual step), in one
        write; else one by one."""
        at, n = synced[stale], lens[stale]
        if (n == at + 1).all() and int(n.max()) <= self.width:
            last = np.fromiter((tables[i][-1] for i in stale.tolist()), np.int64, stale.size)
            if self._first_bad(last) is None:
                self.ids[rows[stale], at] = last
                self._lens[rows[stale]] = n
                self.num_writes += stale.size
                return
        for i in stale.tolist():  # (also names a table holding a bad id)
            self._sync(int(rows[i]), tables[i], i)

    def _add(self, table: Sequence[int], index: int) -> int:
        if not self._free:
            self._drop_unused()
        row = self._free.pop()
        self._stamp[row] = self._build
        self._owner[row] = table
        self._row_of[id(table)] = row
        self._sync(row, table, index)
        return row

    def _sync(self, row: int, table: Sequence[int], index: int) -> None:
        """Write what ``table`` gained since ``row`` was synced (all of it after a shrink,
        which the contract rules out but costs nothing to survive)."""
        start, n = int(self._lens[row]), len(table)
        if n < start:
            self.ids[row, n:start] = 0
            start = 0
        new = np.asarray(table[start:n], np.int64)
        bad = self._first_bad(new)
        if bad is not None:
            raise ValueError(f"chunk {index}: block id {bad} outside [0, {self.num_blocks})")
        if n > self.width:
            self._widen(n)
        self.ids[row, start:n] = new
        self._lens[row] = n
        self.num_writes += 1

    def _first_bad(self, ids: np.ndarray) -> int | None:
        """The first of ``ids`` outside ``[0, num_blocks)``, if any."""
        if self.num_blocks is None or not ids.size:
            return None
        bad = (ids < 0) | (ids >= self.num_blocks)
        return int(ids[bad][0]) if bad.any() else None

    def _drop_unused(self) -> None:
        unused = np.flatnonzero(self._stamp != self._build).tolist()
        if not unused:  # every row is in this build: double the capacity
            self._grow_rows()
            return
        for row in unused:
            table = self._owner[row]
            if table is not None:
                del self._row_of[id(table)]
                self._owner[row] = None
                self.ids[row, : self._lens[row]] = 0
                self._lens[row] = 0
                self._free.append(row)

    def _grow_rows(self) -> None:
        old = self.ids.shape[0]
        self.ids = np.concatenate([self.ids, np.zeros_like(self.ids)])
        self._lens = np.concatenate([self._lens, np.zeros(old, np.int64)])
        self._stamp = np.concatenate([self._stamp, np.zeros(old, np.int64)])
        self._owner.extend([None] * old)
        self._free.extend(range(2 * old - 1, old - 1, -1))

    def _widen(self, n: int) -> None:
        width = self.width
        while width < n:
            width *= 2
        wider = np.zeros((self.ids.shape[0], width), np.int32)
        wider[:, : self.width] = self.ids
        self.ids = wider

    def _check(self, rows: np.ndarray, tables: Sequence[Sequence[int]]) -> None:
        for i, (row, table) in enumerate(zip(rows.tolist(), tables, strict=True)):
            n = len(table)
            if self.ids[row, :n].tolist() != list(table) or self.ids[row, n:].any():
                raise AssertionError(
                    f"chunk {i}: the host block table row {row} is stale: a table passed "
                    "again as the same object was changed other than by appending"
                )
