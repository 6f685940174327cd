"""The host tier's memory: a block-manager pool's host slots, each one block of every layer's
K and V in one contiguous region (the copies run in whole blocks across all layers), in
pinned memory on CUDA, plain memory on the CPU.

The block manager decides every move; :meth:`HostKVCache.move` performs a Step's, offloads
(device to host) first, then onboards (host to device). Each is one gather or scatter of whole
blocks. Both are synchronous for now: an offload's bytes are in the slots, and an onboard's in
the cache, when it returns, so no later write (a copy-on-write, the forward, the next Step's
offload into the same slot) can overtake them. Overlapping them with the forward on their own
CUDA streams, with events guarding the slots, is the next step (not yet run on a GPU).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["HostKVCache"]


class HostKVCache:
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
    ) -> None:
        """``(device block, host slot)`` pairs: offloads first, then onboards."""
        device = kv_cache.device
        if offloads:
            blocks, slots = _ids(offloads)
            # [S, 2, n, BS, Hkv, D] -> [n, S, 2, BS, Hkv, D]: one region per block
            data = kv_cache[:, :, blocks.to(device)].permute(2, 0, 1, 3, 4, 5)
            self.slots[slots] = data.to("cpu")  # blocking: the bytes are there on return
        if onboards:
            blocks, slots = _ids(onboards)
            data = self.slots[slots].to(device)
            kv_cache[:, :, blocks.to(device)] = data.permute(1, 2, 0, 3, 4, 5)
            if device.type == "cuda":
                torch.cuda.current_stream(device).synchronize()


def _ids(pairs: Sequence[tuple[int, int]]) -> tuple[Tensor, Tensor]:
    ids = torch.tensor(pairs, dtype=torch.int64)
    return ids[:, 0], ids[:, 1]
