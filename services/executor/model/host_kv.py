"""The host tier's memory: a block-manager pool's host slots, each one block of every layer's
K and V in one contiguous region (the copies run in whole blocks across all layers), in
pinned memory on CUDA, plain memory on the CPU.

The block manager decides every move; :meth:`HostKVCache.move` performs a Step's, offloads
(device to host) first, then onboards (host to device). Each is one gather or scatter of whole
blocks. Both are synchronous for now: an offload's bytes are in the slots, and an onboard's in
the cache, when it returns, so no later write (a copy-on-write, the forward, the next Step's
offload into the same slot) can overtake them. Overlapping them with the forward on their own
CUDA streams, with events guarding the slots, is the next step (not yet run on a GPU).

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
    ) -> None:
        """In this order: spills ``(host slot, disk slot)``; offloads, then onboards,
        ``(device block, host slot)``; loads ``(disk slot, device block)``."""
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
        if onboards:
            blocks, slots = _ids(onboards)
            data = self.slots[slots].to(device)
            kv_cache[:, :, blocks.to(device)] = data.permute(1, 2, 0, 3, 4, 5)
        if loads:
            assert self.disk is not None
            slots, blocks = _ids(loads)
            data = self.disk.slots[slots].to(device)
            kv_cache[:, :, blocks.to(device)] = data.permute(1, 2, 0, 3, 4, 5)
        if (onboards or loads) and device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()


def _ids(pairs: Sequence[tuple[int, int]]) -> tuple[Tensor, Tensor]:
    ids = torch.tensor(pairs, dtype=torch.int64)
    return ids[:, 0], ids[:, 1]
