"""The disk tier's storage (``--kv-offloading-disk-path``): one file of block-sized slots
below the host tier, read and written with ``pread`` / ``pwrite``.

Not memory-mapped: an I/O error on a mapping is a SIGBUS that kills the executor, while a
failed ``pread`` / ``pwrite`` is an OSError the host tier reports to the block manager
(``UncacheOp``): the block is then simply not cached, and the sequences that would have
read it are computed again. The file's blocks are allocated up front (a full disk fails at
start-up, not in the middle of a Step), and it is unlinked as soon as it is open, so it is
this process's alone and goes with it however it ends.
"""

from __future__ import annotations

import errno
import math
import os
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

__all__ = ["DiskKVStore"]


class DiskKVStore:
    def __init__(self, directory: Path, like: Tensor, num_slots: int) -> None:
        """``num_slots`` slots shaped like ``like``'s (a host tier's ``[n, ...]`` slots) in
        a new file under ``directory``. OSError when it cannot be made."""
        self.slot_shape = tuple(like.shape[1:])
        self.dtype = like.dtype
        self.slot_bytes = math.prod(self.slot_shape) * like.element_size()
        self.num_slots = num_slots
        directory.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(prefix="kv-tier-", suffix=".bin", dir=directory)
        try:
            os.unlink(name)
            os.posix_fallocate(fd, 0, num_slots * self.slot_bytes)
        except BaseException:
            os.close(fd)
            raise
        self._fd: int | None = fd

    @property
    def bytes(self) -> int:
        return self.num_slots * self.slot_bytes

    def write(self, slot: int, data: Tensor) -> None:
        """Slot ``slot`` := ``data`` (a contiguous CPU tensor shaped like a slot)."""
        view = _bytes_of(data)
        done = os.pwrite(self._open_fd(), view, slot * self.slot_bytes)
        if done != len(view):
            raise OSError(errno.EIO, f"disk tier slot {slot}: wrote {done} of {len(view)} bytes")

    def read_into(self, slot: int, out: Tensor) -> None:
        """``out`` (a contiguous CPU tensor shaped like a slot) := slot ``slot``."""
        view = _bytes_of(out)
        done = os.preadv(self._open_fd(), [view], slot * self.slot_bytes)
        if done != len(view):
            raise OSError(errno.EIO, f"disk tier slot {slot}: read {done} of {len(view)} bytes")

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def _open_fd(self) -> int:
        if self._fd is None:
            raise OSError(errno.EBADF, "the disk tier is closed")
        return self._fd


def _bytes_of(t: Tensor) -> memoryview:
    """``t``'s memory as writable bytes (no copy)."""
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError("the disk tier copies from and into contiguous CPU tensors")
    array: Any = t.view(torch.uint8).numpy()  # (a buffer: numpy's stubs do not say so)
    return memoryview(array).cast("B")
