"""Sizing and allocating the executor's paged KV cache: one tensor for all layers.

Layout: ``kv_cache[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]``; layer
``l`` reads and writes ``kv_cache[l, 0]`` (K) and ``kv_cache[l, 1]`` (V). Block 0 is
reserved by the block manager and serves as padding in block tables, so a pool of
``num_blocks`` blocks holds ``num_blocks - 1`` usable ones.
"""

from __future__ import annotations

import torch

from services.executor.model_config import ModelConfig

__all__ = ["allocate_kv_cache", "bytes_per_block", "kv_cache_shape", "num_blocks_for_budget"]

MIN_NUM_BLOCKS = 2  # the reserved block 0 plus one usable block


def kv_cache_shape(
    config: ModelConfig, num_blocks: int, block_size: int
) -> tuple[int, int, int, int, int, int]:
    """Shape of the cache tensor: ``[L, 2, num_blocks, block_size, Hkv, D]``."""
    return (config.num_layers, 2, num_blocks, block_size, config.num_kv_heads, config.head_dim)


def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block occupies across all layers, K and V."""
    elem_size = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_layers * block_size * config.num_kv_heads * config.head_dim * elem_size


def num_blocks_for_budget(
    config: ModelConfig, block_size: int, dtype: torch.dtype, budget_bytes: int
) -> int:
    """How many blocks (including the reserved block 0) fit in ``budget_bytes``.

    Raises ``ValueError`` when the budget holds fewer than two blocks (nothing usable).
    """
    num_blocks = budget_bytes // bytes_per_block(config, block_size, dtype)
    if num_blocks < MIN_NUM_BLOCKS:
        raise ValueError(
            f"KV-cache budget of {budget_bytes} bytes holds {num_blocks} blocks of "
            f"{bytes_per_block(config, block_size, dtype)} bytes; need at least {MIN_NUM_BLOCKS}"
        )
    return int(num_blocks)


def allocate_kv_cache(
    config: ModelConfig,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device | str,
) -> torch.Tensor:
    """Allocate the zero-filled cache tensor (zeros so padding reads are finite)."""
    if num_blocks < MIN_NUM_BLOCKS:
        raise ValueError(
            f"num_blocks={num_blocks}: need at least {MIN_NUM_BLOCKS} (block 0 is reserved)"
        )
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    return torch.zeros(kv_cache_shape(config, num_blocks, block_size), dtype=dtype, device=device)
