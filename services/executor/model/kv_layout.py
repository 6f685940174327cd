"""How a model's layers share the paged KV cache: its KV-cache groups (vLLM's hybrid KV-cache
manager) and the layout of the cache tensor.

A KV-cache group is a set of layers of one attention kind (full, or a sliding window W) that
share one block table per sequence. The block manager allocates every group's blocks from one
pool, so a block must be the same size in every group: each group has the same number of
layers, ``num_slots``, and the cache tensor is ``[num_slots, 2, num_blocks, block_size, Hkv,
D]``. Layer ``l`` reads and writes slice ``layer_slot[l]`` of it through the table of group
``layer_group[l]``; a block belongs to one group at a time, so the layers of different groups
that share a slice never meet in one block.

- One kind of layer (full attention everywhere, or one window everywhere): one group of every
  layer, ``num_slots`` = the number of layers, layer ``l`` in slice ``l`` (the plain layout).
- A hybrid model (Gemma 2/3: sliding and full layers), unless the hybrid manager is disabled:
  ``num_slots`` = the smaller of the two layer counts, and each kind's layers, in order, are
  cut into groups of that many. Where a kind's count does not divide, its last group has fewer
  layers and the slices it leaves unused are padding: memory allocated and never read, as in
  vLLM. Gemma 3 (5 sliding layers to 1 full) gets one layer per group and no padding.
- Disabled (``--disable-hybrid-kv-cache-manager``): one full group of every layer, the
  sliding layers keeping every block too.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.common.blocks import blocks_for_tokens, max_live_blocks
from services.executor.model.config import ModelConfig

__all__ = ["KVCacheLayout", "plan_kv_layout"]


@dataclass(frozen=True)
class KVCacheLayout:
    """``windows``: per group, its sliding window (0: full attention). ``group_layers``: the
    layers of each group, in order. ``layer_group`` / ``layer_slot``: per layer, its group and
    its slice of the cache tensor."""

    windows: tuple[int, ...]
    group_layers: tuple[tuple[int, ...], ...]
    layer_group: tuple[int, ...]
    layer_slot: tuple[int, ...]
    num_slots: int

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def sliding_window(self) -> int:
        """The window of the sliding groups (they share one), 0 when none slides."""
        return max(self.windows)

    @property
    def group_slides(self) -> tuple[bool, ...]:
        return tuple(w > 0 for w in self.windows)

    def blocks_per_sequence(self, num_tokens: int, block_size: int, chunk: int = 0) -> int:
        """The most blocks one sequence of ``num_tokens`` tokens holds across the groups: all
        of them in a full group; in a sliding group, decoding, the window's
        (``ceil(W / block_size) + 1``), or with steps of ``chunk`` tokens, the chunk's and the
        window's with a block of slack at each unaligned end."""
        full = blocks_for_tokens(num_tokens, block_size)
        total = 0
        for window in self.windows:
            if not window:
                total += full
            elif chunk:
                total += min(full, blocks_for_tokens(chunk + window + 2 * block_size, block_size))
            else:
                total += min(full, max_live_blocks(window, block_size))
        return total


def plan_kv_layout(config: ModelConfig, *, hybrid: bool = True) -> KVCacheLayout:
    """``config``'s KV-cache groups (see the module docstring)."""
    num_layers, window = config.num_layers, config.sliding_window or 0
    sliding = set(config.sliding_layers) if window else set()
    if config.all_layers_slide or not sliding or not hybrid:
        layers = tuple(range(num_layers))
        win = window if config.all_layers_slide else 0
        return KVCacheLayout((win,), (layers,), (0,) * num_layers, layers, num_layers)
    kinds = (
        [layer for layer in range(num_layers) if layer not in sliding],
        [layer for layer in range(num_layers) if layer in sliding],
    )
    size = min(len(k) for k in kinds)
    groups = sorted(
        (tuple(kind[i : i + size]), window if kind is kinds[1] else 0)
        for kind in kinds
        for i in range(0, len(kind), size)
    )
    layer_group = [0] * num_layers
    layer_slot = [0] * num_layers
    for g, (layers, _) in enumerate(groups):
        for slot, layer in enumerate(layers):
            layer_group[layer], layer_slot[layer] = g, slot
    return KVCacheLayout(
        tuple(w for _, w in groups),
        tuple(layers for layers, _ in groups),
        tuple(layer_group),
        tuple(layer_slot),
        size,
    )
