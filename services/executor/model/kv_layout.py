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
- A hybrid model (Gemma 2/3: sliding and full layers), unless the hybrid manager is disabled,
  is grouped as vLLM groups it: ``num_slots`` is the smaller of the two layer counts (the
  larger when it is under 1.25 times the smaller, to save groups), and each kind's layers are
  cut, strided, into ``ceil(count / num_slots)`` groups. Where a kind's count does not divide,
  some groups have fewer layers and the slices they leave unused are padding: memory allocated
  and never read (logged as ``kv_cache_padding``). Gemma 3 27B (52 sliding, 10 global layers)
  gets 10 slots, 6 sliding groups and 1 global (8 padding slots, 11% of the cache); the tiny
  5:1 test shape one layer per group; alternating Gemma 2 two groups of half the layers.
- Disabled (``--disable-hybrid-kv-cache-manager``): one full group of every layer, the
  sliding layers keeping every block too.
"""

from __future__ import annotations

from dataclasses import dataclass

import structlog

from services.common.blocks import blocks_for_tokens, max_live_blocks
from services.executor.model.config import ModelConfig

log = structlog.get_logger(__name__)

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
        every = tuple(range(num_layers))
        win = window if config.all_layers_slide else 0
        return KVCacheLayout((win,), (every,), (0,) * num_layers, every, num_layers)
    kinds = (
        (0, [layer for layer in range(num_layers) if layer not in sliding]),
        (window, [layer for layer in range(num_layers) if layer in sliding]),
    )
    counts = sorted(len(layers) for _, layers in kinds)
    size = counts[1] if counts[1] < 1.25 * counts[0] else counts[0]
    groups: list[tuple[tuple[int, ...], int]] = []
    padding = 0
    for kind_window, layers in kinds:
        n = -(-len(layers) // size)
        padding += n * size - len(layers)
        # Strided, as vLLM cuts them: group i holds layers i, i + n, i + 2n, ...
        groups.extend((tuple(layers[i::n]), kind_window) for i in range(n))
    groups.sort()
    if padding:
        log.warning(
            "kv_cache_padding",
            padding_slots=padding,
            num_slots=size,
            num_groups=len(groups),
            share=round(padding / (size * len(groups)), 3),
        )
    layer_group = [0] * num_layers
    layer_slot = [0] * num_layers
    for g, (members, _) in enumerate(groups):
        for slot, layer in enumerate(members):
            layer_group[layer], layer_slot[layer] = g, slot
    return KVCacheLayout(
        tuple(w for _, w in groups),
        tuple(members for members, _ in groups),
        tuple(layer_group),
        tuple(layer_slot),
        size,
    )
