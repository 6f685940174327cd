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

The disk tier below it (:class:`DiskKVStore`, ``--kv-offloading-disk-path``) is one file of
slots of the same shape, memory-mapped: a spill copies a host slot into a disk slot (a host
slot the block manager evicts for other content), a load a disk slot into a device block. The
file is unlinked once mapped (the kernel writes it back in its own time): a restarted executor
starts with an empty tier, as the block manager's tier map lives with the pool.
"""

from __future__ import annotations

import math
import os
import tempfile
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import nullcontext
from pathlib import Path

import torch
from torch import Tensor

__all__ = ["DiskKVStore", "HostKVCache"]


class DiskKVStore:
    def __init__(self, directory: Path, like: Tensor, num_slots: int) -> None:
        """``num_slots`` slots shaped like ``like``'s (a host tier's ``[n, ...]`` slots) in a
        new file under ``directory``: its blocks allocated up front (a full disk is an error
        now, not a SIGBUS in the middle of a Step), mapped, then unlinked, so that it is this
        process's alone and goes with it however it ends. OSError when that fails."""
        per_slot = tuple(like.shape[1:])
        numel = num_slots * math.prod(per_slot)
        directory.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(prefix="kv-tier-", suffix=".bin", dir=directory)
        try:
            os.posix_fallocate(fd, 0, numel * like.element_size())
            flat = torch.from_file(name, shared=True, size=numel, dtype=like.dtype)
        finally:
            os.close(fd)
            os.unlink(name)
        self.slots = flat.view(num_slots, *per_slot)
        self.num_slots = num_slots

    @property
    def bytes(self) -> int:
        return self.slots.numel() * self.slots.element_size()


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
        self._fills: Future[None] | None = None  # the fills in flight, if any
        self._worker: ThreadPoolExecutor | None = None  # made at the first async fill
        self._stream: torch.cuda.Stream | None = None  # its copy stream (CUDA)

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
        *,
        fill_async: bool = False,
    ) -> None:
        """In this order: spills ``(host slot, disk slot)``; offloads, then onboards,
        ``(device block, host slot)``; loads ``(disk slot, device block)``. The fills in
        flight from an earlier call are waited for first. ``fill_async``: the onboards and
        loads are still running on return (see :meth:`wait_fills`); the stores never are."""
        self.wait_fills()
        device = kv_cache.device
        if (spills or loads) and self.disk is None:
            raise RuntimeError("the block manager ordered disk-tier moves; this runner has none")
        if spills:
            assert self.disk is not None
            src, dst = _ids(spills)
            self.disk.slots[dst] = self.slots[src]
        if offloads:
            blocks, slots = _ids(offloads)
            # [S, 2, n, BS, Hkv, D] -> [n, S, 2, BS, Hkv, D]: one region per block
            data = kv_cache[:, :, blocks.to(device)].permute(2, 0, 1, 3, 4, 5)
            self.slots[slots] = data.to("cpu")  # blocking: the bytes are there on return
        if not (onboards or loads):
            return
        if not fill_async:
            self._fill(kv_cache, onboards, loads, None)
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
        """Return once every fill started is in the KV cache (re-raising its error)."""
        fills, self._fills = self._fills, None
        if fills is not None:
            fills.result()

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

    def _fill(
        self,
        kv_cache: Tensor,
        onboards: Sequence[tuple[int, int]],
        loads: Sequence[tuple[int, int]],
        stream: torch.cuda.Stream | None,
    ) -> None:
        """The fills, on ``stream`` (CUDA; None: the current stream), done on return. One
        copy per block, straight from its slot (pinned memory on CUDA: no staging on the
        host, no gather that would start a thread team of its own beside the forward's)."""
        device = kv_cache.device
        disk = self.disk.slots if self.disk is not None else None
        # (inference mode is per thread: the cache is an inference tensor)
        with torch.inference_mode(), torch.cuda.stream(stream) if stream else nullcontext():
            for block, slot in onboards:
                kv_cache[:, :, block].copy_(self.slots[slot], non_blocking=True)
            for slot, block in loads:
                assert disk is not None
                kv_cache[:, :, block].copy_(disk[slot], non_blocking=True)
            if device.type == "cuda":
                (stream or torch.cuda.current_stream(device)).synchronize()


def _ids(pairs: Sequence[tuple[int, int]]) -> tuple[Tensor, Tensor]:
    ids = torch.tensor(pairs, dtype=torch.int64)
    return ids[:, 0], ids[:, 1]
