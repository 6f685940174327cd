"""Sizing the one KV-cache tensor from a byte budget."""

from __future__ import annotations

import pytest
import torch

from services.executor.model.config import ModelConfig
from services.executor.model.kv_cache import (
    allocate_kv_cache,
    bytes_per_block,
    kv_cache_shape,
    num_blocks_for_budget,
)

from .test_model_config import LLAMA2_7B, LLAMA31_8B

LLAMA2 = ModelConfig.from_hf_config(LLAMA2_7B)
LLAMA31 = ModelConfig.from_hf_config(LLAMA31_8B)


def test_bytes_per_block_counts_k_and_v_of_every_layer() -> None:
    # Llama-2-7B, fp16, 16 tokens: 2 (K,V) * 32 layers * 16 * 32 heads * 128 dims * 2 bytes.
    assert bytes_per_block(LLAMA2, 16, torch.float16) == 8 * 2**20
    # Llama-3.1-8B has 8 KV heads (GQA): a quarter of that.
    assert bytes_per_block(LLAMA31, 16, torch.bfloat16) == 2 * 2**20
    assert bytes_per_block(LLAMA31, 32, torch.float32) == 8 * 2**20


def test_num_blocks_for_budget_floors_and_counts_reserved_block() -> None:
    per_block = bytes_per_block(LLAMA31, 16, torch.bfloat16)
    assert num_blocks_for_budget(LLAMA31, 16, torch.bfloat16, 10 * per_block + per_block - 1) == 10
    with pytest.raises(ValueError, match="need at least 2"):
        num_blocks_for_budget(LLAMA31, 16, torch.bfloat16, 2 * per_block - 1)


def test_allocate_gives_one_zeroed_tensor_in_the_agreed_layout() -> None:
    config = ModelConfig.from_hf_config(
        {**LLAMA2_7B, "num_hidden_layers": 3, "num_key_value_heads": 4, "head_dim": 8}
    )
    cache = allocate_kv_cache(
        config, num_blocks=5, block_size=4, dtype=torch.bfloat16, device="cpu"
    )
    assert cache.shape == kv_cache_shape(config, 5, 4, torch.float32) == (3, 2, 5, 4, 4, 8)
    assert cache.dtype == torch.bfloat16 and cache.is_contiguous()
    assert not cache.any()
    assert cache.numel() * cache.element_size() == 5 * bytes_per_block(config, 4, torch.bfloat16)


def test_allocate_rejects_a_pool_without_a_usable_block() -> None:
    with pytest.raises(ValueError, match="block 0 is reserved"):
        allocate_kv_cache(LLAMA2, num_blocks=1, block_size=16, dtype=torch.float16, device="meta")
