"""The torch reference (test oracle and CPU serving path) against naive definitions.

``dense_attention`` computes each (token, head) output with an explicit per-key softmax
in fp64 — slow but obviously right — so the oracle the Triton kernels are compared with
is itself checked for causality, GQA head mapping, paging and mixed batches.
"""

from __future__ import annotations

import pytest
import torch

from kernels import reference
from kernels.testing import MIXED_BATCH, dense_attention, make_paged_batch


@pytest.mark.parametrize(
    ("num_q_heads", "num_kv_heads", "block_size"),
    [(4, 4, 16), (8, 2, 32), (5, 1, 16)],
    ids=["gqa4:4-bs16", "gqa8:2-bs32", "gqa5:1-bs16"],
)
def test_reference_attention_matches_naive_dense_causal_gqa(
    num_q_heads: int, num_kv_heads: int, block_size: int
) -> None:
    batch = make_paged_batch(
        MIXED_BATCH,
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_dim=16,
        block_size=block_size,
        num_pad_tokens=2,
    )
    out = reference.paged_attention(*batch.args())
    torch.testing.assert_close(out, dense_attention(batch), atol=1e-5, rtol=1e-5)


def test_reference_attention_fp16_returns_fp16_computed_in_fp32() -> None:
    batch = make_paged_batch(
        MIXED_BATCH,
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=16,
        block_size=16,
        dtype=torch.float16,
    )
    out = reference.paged_attention(*batch.args())
    assert out.dtype == torch.float16
    torch.testing.assert_close(out.float(), dense_attention(batch), atol=2e-3, rtol=2e-3)


def test_reference_attention_padding_rows_are_zero() -> None:
    batch = make_paged_batch(
        [(3, 2), (0, 4)],
        num_q_heads=2,
        num_kv_heads=1,
        head_dim=16,
        block_size=16,
        num_pad_tokens=3,
    )
    batch.query[-3:] = float("nan")  # padding rows must not leak into the output
    out = reference.paged_attention(*batch.args())
    assert torch.equal(out[-3:], torch.zeros_like(out[-3:]))
    assert torch.isfinite(out).all()


def test_reference_attention_is_causal_future_cache_slots_are_ignored() -> None:
    """Changing K/V at positions after a token's own must not change its output."""
    batch = make_paged_batch([(5, 6)], num_q_heads=2, num_kv_heads=2, head_dim=16, block_size=16)
    before = reference.paged_attention(*batch.args())
    block = int(batch.block_tables[0, 0])
    batch.key_cache[block, 10] += 100.0  # position 10: only the last query token sees it
    batch.value_cache[block, 10] += 100.0
    after = reference.paged_attention(*batch.args())
    torch.testing.assert_close(after[:5], before[:5])
    assert not torch.allclose(after[5], before[5])


def test_reference_reshape_and_cache_writes_slots_and_skips_padding() -> None:
    num_blocks, block_size, heads, dim = 4, 4, 2, 8
    key_cache = torch.randn(num_blocks, block_size, heads, dim)
    value_cache = torch.randn(num_blocks, block_size, heads, dim)
    expected_k, expected_v = key_cache.clone(), value_cache.clone()
    key, value = torch.randn(4, heads, dim), torch.randn(4, heads, dim)
    slot_mapping = torch.tensor([13, -1, 2, 7])
    reference.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot >= 0:
            expected_k[slot // block_size, slot % block_size] = key[t]
            expected_v[slot // block_size, slot % block_size] = value[t]
    assert torch.equal(key_cache, expected_k)
    assert torch.equal(value_cache, expected_v)


def test_reference_reshape_and_cache_writes_through_layer_views() -> None:
    kv_cache = torch.zeros(2, 2, 3, 4, 1, 8)  # [L, 2, NB, BS, Hkv, D]
    key, value = torch.ones(1, 1, 8), torch.full((1, 1, 8), 2.0)
    reference.reshape_and_cache(key, value, kv_cache[1, 0], kv_cache[1, 1], torch.tensor([9]))
    assert torch.equal(kv_cache[1, 0, 2, 1], key[0])
    assert torch.equal(kv_cache[1, 1, 2, 1], value[0])
    assert kv_cache.sum() == 8 * 3


def test_reference_copy_blocks_copies_every_layer_k_and_v() -> None:
    kv_cache = torch.randn(3, 2, 6, 4, 2, 8)
    before = kv_cache.clone()
    reference.copy_blocks(kv_cache, torch.tensor([1, 4]), torch.tensor([5, 2]))
    assert torch.equal(kv_cache[:, :, 5], before[:, :, 1])
    assert torch.equal(kv_cache[:, :, 2], before[:, :, 4])
    untouched = [0, 1, 3, 4]
    assert torch.equal(kv_cache[:, :, untouched], before[:, :, untouched])
