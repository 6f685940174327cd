"""The torch reference (test oracle and CPU serving path) against naive definitions.

``dense_attention`` computes each (token, head) output with an explicit per-key softmax
in fp64 — slow but obviously right — so the oracle the Triton kernels are compared with
is itself checked for causality, GQA head mapping, paging and mixed batches.
"""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels import reference
from pagedserve.kernels.testing import MIXED_BATCH, PagedBatch, dense_attention, make_paged_batch


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


def _dense_windowed_attention(
    batch: PagedBatch, window: int | None, soft_cap: float | None
) -> torch.Tensor:  # [T, Hq, D] fp32
    """Brute force, fp64: each sequence's full K/V read slot by slot through its block
    table, scores for every (query, key) pair, soft-cap, then a mask built from the
    positions alone: key j is visible to the query at position p iff
    ``j <= p and (no window or j > p - window)``."""
    query = batch.query.double()
    key_cache, value_cache = batch.key_cache.double(), batch.value_cache.double()
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = query.shape[1] // num_kv_heads
    starts = batch.query_start_loc.tolist()
    out = torch.zeros_like(query)
    for b, seq_len in enumerate(batch.seq_lens.tolist()):
        table = batch.block_tables[b].tolist()
        slots = [(table[j // block_size], j % block_size) for j in range(seq_len)]
        keys = torch.stack([key_cache[blk, off] for blk, off in slots])  # [S, Hkv, D]
        values = torch.stack([value_cache[blk, off] for blk, off in slots])
        keys = keys.repeat_interleave(group, dim=1)  # [S, Hq, D]
        values = values.repeat_interleave(group, dim=1)
        q_len = starts[b + 1] - starts[b]
        for i in range(q_len):
            t, p = starts[b] + i, seq_len - q_len + i
            scores = torch.einsum("hd,shd->hs", query[t], keys) * batch.scale  # [Hq, S]
            if soft_cap:
                scores = soft_cap * torch.tanh(scores / soft_cap)
            visible = torch.tensor(
                [j <= p and (not window or j > p - window) for j in range(seq_len)]
            )
            scores = scores.masked_fill(~visible, float("-inf"))
            out[t] = torch.einsum("hs,shd->hd", torch.softmax(scores, dim=-1), values)
    return out.float()


@pytest.mark.parametrize(
    ("window", "soft_cap"),
    [(None, None), (1, None), (5, None), (16, None), (37, None), (None, 1.5), (7, 1.5)],
    ids=["full", "w1", "w5", "w16", "w37", "cap1.5", "w7-cap1.5"],
)
@pytest.mark.parametrize("block_size", [1, 16])
def test_reference_window_and_soft_cap_match_brute_force_dense_positions_mask(
    window: int | None, soft_cap: float | None, block_size: int
) -> None:
    batch = make_paged_batch(
        MIXED_BATCH,
        num_q_heads=6,
        num_kv_heads=2,
        head_dim=16,
        block_size=block_size,
        num_pad_tokens=2,
    )
    out = reference.paged_attention(*batch.args(), sliding_window=window, logits_soft_cap=soft_cap)
    expected = _dense_windowed_attention(batch, window, soft_cap)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    if window is None and soft_cap is None:  # the brute force agrees with the naive oracle
        torch.testing.assert_close(expected, dense_attention(batch), atol=1e-6, rtol=1e-6)


def test_reference_window_of_zero_or_past_the_context_is_full_attention() -> None:
    batch = make_paged_batch(MIXED_BATCH, num_q_heads=4, num_kv_heads=2, head_dim=16, block_size=16)
    full = reference.paged_attention(*batch.args())
    for window in (0, 64, 10_000):  # MIXED_BATCH's longest context is 64
        torch.testing.assert_close(
            reference.paged_attention(*batch.args(), sliding_window=window, logits_soft_cap=0.0),
            full,
            atol=0.0,
            rtol=0.0,
        )
    narrower = reference.paged_attention(*batch.args(), sliding_window=63)
    assert not torch.allclose(narrower, full)


def test_reference_window_hides_keys_before_it() -> None:
    """Changing K/V at positions before every query's window must not change anything."""
    batch = make_paged_batch([(20, 3)], num_q_heads=2, num_kv_heads=1, head_dim=16, block_size=4)
    before = reference.paged_attention(*batch.args(), sliding_window=4)  # sees 17-20 .. 19-22
    block = int(batch.block_tables[0, 4])  # positions 16..19: 16 unseen by all, 17 by one
    batch.key_cache[block, 0] += 100.0
    batch.value_cache[block, 0] += 100.0
    torch.testing.assert_close(reference.paged_attention(*batch.args(), sliding_window=4), before)
    batch.value_cache[block, 1] += 100.0  # position 17: in the window of position 20 only
    after = reference.paged_attention(*batch.args(), sliding_window=4)
    torch.testing.assert_close(after[1:], before[1:])
    assert not torch.allclose(after[0], before[0])
