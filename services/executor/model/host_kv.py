"""The host tier's memory: a block-manager pool's host slots, each one block of every layer's
K and V in one contiguous region (the copies run in whole blocks across all layers), in
pinned memory on CUDA, plain memory on the CPU.

The block manager decides every move; :meth:`HostKVCache.move` performs a Step's: the stores
(spills, then offloads, device to host) at once, the fills (onboards from the host, loads from
the disk, into device blocks) at once too, or, with ``fill_async``, on a worker thread (on
CUDA, on a copy stream of its own) while the step's forward runs. Each is one gather or
scatter of whole blocks (a store) or one copy per block (a fill).

Why this is safe without a confirmation round trip: a store's bytes are in its slot when
``move`` returns, before anything can overwrite its device block (a copy-on-write, the
forward). Fills in flight are waited for (:meth:`HostKVCache.wait_fills`) before the next
Step's moves, which are the first writes that may reuse the slots they read (the block
manager frees an onboarded slot from the next Step on), and before any forward reads their
blocks: the scheduler holds back every chunk whose tables hold a block being filled
(``SchedulerConfig.defer_filled_chunks``) until the step after, and the engine waits at the
start of each step. Filled blocks sit in their sequences' tables, so nothing evicts them
meanwhile.

The disk tier below it (:class:`~.disk_kv.DiskKVStore`, ``--kv-offloading-disk-path``) is
one file of slots of the same shape: a spill writes a host slot into a disk slot (a host slot
the block manager evicts for other content), a load reads a disk slot into a device block.
A disk move can fail (an I/O error): it loses nothing. The failure is recorded
(:meth:`HostKVCache.take_failures`) for the engine to report in its next Step (the block
manager forgets what the block or slot was cached as) and to recompute the sequences that
listed a block whose load failed, before anything reads it. A load from a disk slot whose
spill failed is a failed load too (the block manager may order it before it hears of the
failure); the slot is good again once a spill into it succeeds.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import nullcontext
from typing import NamedTuple

import structlog
import torch
from torch import Tensor

from services.executor.model.disk_kv import DiskKVStore

log = structlog.get_logger(__name__)


class MoveFailures(NamedTuple):
    """Moves that failed: device blocks a load could not fill, disk slots a spill could not
    write."""

    device_blocks: list[int]
    disk_slots: list[int]


__all__ = ["HostKVCache", "MoveFailures"]


class HostKVCache:
    disk: DiskKVStore | None = None  # the disk tier below, if any

    def __init__(self, kv_cache: Tensor, num_slots: int) -> None:
        """Slots shaped like one block of ``kv_cache`` (``[S, 2, NB, BS, Hkv, D]``)."""
        per_slot = (kv_cache.shape[0], 2, *kv_cache.shape[3:])  # [S, 2, BS, Hkv, D]
        pin = kv_cache.device.type == "cuda"
        self.slots = torch.zeros(
            (num_slots, *per_slot), dtype=kv_cache.dtype, device="cpu", pin_memory=pin
        )
        self.num_slots = num_slots
        self._fills: Future[MoveFailures] | None = None  # the fills in flight, if any
        self._worker: ThreadPoolExecutor | None = None  # made at the first async fill
        self._stream: torch.cuda.Stream | None = None  # its copy stream (CUDA)
        # A failed disk move: recorded for the engine to report (rank 0), or raised (the
        # other tensor-parallel ranks: their block would differ from rank 0's unseen).
        self.report_failures = True
        self._failed = MoveFailures([], [])
        self._bad_disk_slots: set[int] = set()  # a spill into them failed

    @property
    def bytes(self) -> int:
        return self.slots.numel() * self.slots.element_size()

    @torch.inference_mode()
    def move(
        self,
        kv_cache: Tensor,
        offloads: Sequence[tuple[int, int]],
        onboards: Sequence[tuple[int, int]],
        spills: Sequence[tuple[int, int]] = (),
        loads: Sequence[tuple[int, int]] = (),
        stores: Sequence[tuple[int, int]] = (),
        *,
        fill_async: bool = False,
    ) -> None:
        """In this order: spills ``(host slot, disk slot)``; offloads ``(device block, host
        slot)``; stores ``(device block, disk slot)``; onboards ``(device block, host
        slot)``; loads ``(disk slot, device block)``. The fills in flight from an earlier call
        are waited for first. ``fill_async``: the onboards and loads are still running on
        return (see :meth:`wait_fills`); the others (spills, offloads, stores) never are."""
        self.wait_fills()
        device = kv_cache.device
        if (spills or loads or stores) and self.disk is None:
            raise RuntimeError("the block manager ordered disk-tier moves; this runner has none")
        for src, dst in spills:
            assert self.disk is not None
            try:
                self.disk.write(dst, self.slots[src])
            except OSError as exc:
                self._failed_move(self._failed, "spill", exc, disk_slot=dst)
            else:
                self._bad_disk_slots.discard(dst)
        if offloads:
            blocks, slots = _ids(offloads)
            # [S, 2, n, BS, Hkv, D] -> [n, S, 2, BS, Hkv, D]: one region per block
            data = kv_cache[:, :, blocks.to(device)].permute(2, 0, 1, 3, 4, 5)
            self.slots[slots] = data.to("cpu")  # blocking: the bytes are there on return
        if stores:
            self._store(kv_cache, stores)
        if not (onboards or loads):
            return
        if not fill_async:
            self._merge(self._fill(kv_cache, onboards, loads, None))
            return
        if device.type == "cuda":
            if self._stream is None:
                self._stream = torch.cuda.Stream(device)
            # Behind everything queued so far (an offload's read of a block filled now).
            self._stream.wait_stream(torch.cuda.current_stream(device))
        if self._worker is None:
            self._worker = ThreadPoolExecutor(1, thread_name_prefix="kv-fills")
        self._fills = self._worker.submit(self._fill, kv_cache, onboards, loads, self._stream)

    def wait_fills(self) -> None:
        """Return once every fill started is in the KV cache (re-raising its error), its
        failures recorded for :meth:`take_failures`."""
        fills, self._fills = self._fills, None
        if fills is not None:
            self._merge(fills.result())

    def take_failures(self) -> MoveFailures:
        """The disk moves that failed since the last call, among those done (the fills left
        running are not: :meth:`wait_fills` first to have theirs)."""
        failed, self._failed = self._failed, MoveFailures([], [])
        return failed

    def _merge(self, failed: MoveFailures) -> None:
        """(Main thread only: a fill's worker returns its failures rather than record them.)"""
        self._failed.device_blocks.extend(failed.device_blocks)
        self._failed.disk_slots.extend(failed.disk_slots)

    def _failed_move(
        self,
        into: MoveFailures,
        kind: str,
        exc: OSError,
        *,
        disk_slot: int = -1,
        device_block: int = -1,
    ) -> None:
        if not self.report_failures:
            raise exc
        log.error("kv_tier_move_failed", move=kind, disk_slot=disk_slot, error=str(exc))
        if kind in ("spill", "store"):  # (main thread only: the fills never write these)
            self._bad_disk_slots.add(disk_slot)
            into.disk_slots.append(disk_slot)
        if device_block >= 0:
            into.device_blocks.append(device_block)

    @property
    def filling(self) -> bool:
        """Fills are in flight."""
        return self._fills is not None

    def close(self) -> None:
        """Wait for the fills in flight and stop the worker thread."""
        try:
            self.wait_fills()
        finally:
            if self._worker is not None:
                self._worker.shutdown()
                self._worker = None
            if self.disk is not None:
                self.disk.close()

    def _fill(
        self,
        kv_cache: Tensor,
        onboards: Sequence[tuple[int, int]],
        loads: Sequence[tuple[int, int]],
        stream: torch.cuda.Stream | None,
    ) -> MoveFailures:
        """The fills, on ``stream`` (CUDA; None: the current stream), done on return; returns
        the loads that failed. One copy per block, straight from its slot (pinned memory on
        CUDA: no staging on the host, no gather that would start a thread team of its own
        beside the forward's)."""
        device = kv_cache.device
        failed = MoveFailures([], [])
        # (inference mode is per thread: the cache is an inference tensor)
        with torch.inference_mode(), torch.cuda.stream(stream) if stream else nullcontext():
            for block, slot in onboards:
                kv_cache[:, :, block].copy_(self.slots[slot], non_blocking=True)
            if loads:
                self._load(kv_cache, loads, failed)
            if device.type == "cuda":
                (stream or torch.cuda.current_stream(device)).synchronize()
        return failed

    def _store(self, kv_cache: Tensor, stores: Sequence[tuple[int, int]]) -> None:
        """Write each device block to its disk slot (through host memory)."""
        disk = self.disk
        assert disk is not None
        blocks = torch.tensor([b for b, _ in stores], dtype=torch.int64, device=kv_cache.device)
        data = kv_cache[:, :, blocks].permute(2, 0, 1, 3, 4, 5).to("cpu").contiguous()
        for i, (_, slot) in enumerate(stores):
            try:
                disk.write(slot, data[i])
            except OSError as exc:
                self._failed_move(self._failed, "store", exc, disk_slot=slot)
            else:
                self._bad_disk_slots.discard(slot)

    def _load(
        self, kv_cache: Tensor, loads: Sequence[tuple[int, int]], failed: MoveFailures
    ) -> None:
        """Read each disk slot into a staging slot (pinned on CUDA), then into its block;
        a read that fails goes to ``failed``."""
        disk = self.disk
        assert disk is not None
        pin = kv_cache.device.type == "cuda"
        staging = torch.empty((len(loads), *disk.slot_shape), dtype=disk.dtype, pin_memory=pin)
        for i, (slot, block) in enumerate(loads):
            try:
                if slot in self._bad_disk_slots:
                    raise OSError(f"disk tier slot {slot}: its spill failed")
                disk.read_into(slot, staging[i])
            except OSError as exc:
                self._failed_move(failed, "load", exc, disk_slot=slot, device_block=block)
                continue
            kv_cache[:, :, block].copy_(staging[i], non_blocking=True)


def _ids(pairs: Sequence[tuple[int, int]]) -> tuple[Tensor, Tensor]:
    ids = torch.tensor(pairs, dtype=torch.int64)
    return ids[:, 0], ids[:, 1]
