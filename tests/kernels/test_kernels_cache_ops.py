"""Triton reshape_and_cache and copy_blocks against the torch reference.

Runs under the Triton interpreter on CPU; also through ``pagedserve.kernels.ops`` with
``PAGEDSERVE_FORCE_TRITON=1`` to prove the dispatch reaches the kernels.
"""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels import ops, reference
from pagedserve.kernels.copy_blocks import copy_blocks_triton
from pagedserve.kernels.reshape_and_cache import reshape_and_cache_triton
from pagedserve.kernels.testing import PAIRWISE_CASES, KernelCase

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _caches(case: KernelCase, num_blocks: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (num_blocks, case.block_size, case.num_kv_heads, case.head_dim)
    gen = torch.Generator().manual_seed(1)
    return (
        torch.randn(shape, generator=gen).to(case.dtype).to(DEVICE),
        torch.randn(shape, generator=gen).to(case.dtype).to(DEVICE),
    )


@pytest.mark.parametrize("case", PAIRWISE_CASES, ids=lambda c: c.id)
def test_reshape_and_cache_matches_reference_and_skips_padding_slots(case: KernelCase) -> None:
    bs = case.block_size
    # Slots off block boundaries, across blocks, in no order, with padding (-1) mixed in.
    slots = [3 * bs + 5, -1, 1 * bs, 5 * bs + bs - 1, -1, 2 * bs + 7, 1 * bs + 1]
    slot_mapping = torch.tensor(slots, dtype=torch.int64, device=DEVICE)
    shape = (len(slots), case.num_kv_heads, case.head_dim)
    key = torch.randn(shape).to(case.dtype).to(DEVICE)
    value = torch.randn(shape).to(case.dtype).to(DEVICE)
    key_cache, value_cache = _caches(case)
    expected_k, expected_v = key_cache.clone(), value_cache.clone()
    reference.reshape_and_cache(key, value, expected_k, expected_v, slot_mapping)
    reshape_and_cache_triton(key, value, key_cache, value_cache, slot_mapping)
    assert torch.equal(key_cache, expected_k)  # a copy: bit-exact, and nothing else touched
    assert torch.equal(value_cache, expected_v)


def test_reshape_and_cache_all_padding_leaves_cache_untouched() -> None:
    case = PAIRWISE_CASES[0]
    key_cache, value_cache = _caches(case)
    before_k, before_v = key_cache.clone(), value_cache.clone()
    kv = torch.randn(3, case.num_kv_heads, case.head_dim, device=DEVICE)
    slot_mapping = torch.full((3,), -1, dtype=torch.int64, device=DEVICE)
    reshape_and_cache_triton(kv, kv, key_cache, value_cache, slot_mapping)
    assert torch.equal(key_cache, before_k)
    assert torch.equal(value_cache, before_v)


def test_reshape_and_cache_accepts_strided_views_of_a_fused_qkv_and_layer_cache() -> None:
    """K/V sliced out of a fused QKV output; caches are views of one [L, 2, ...] tensor."""
    num_q_heads, num_kv_heads, head_dim, block_size = 4, 2, 64, 16
    qkv = torch.randn(5, num_q_heads + 2 * num_kv_heads, head_dim, device=DEVICE)
    key = qkv[:, num_q_heads : num_q_heads + num_kv_heads]
    value = qkv[:, num_q_heads + num_kv_heads :]
    kv_cache = torch.randn(2, 2, 4, block_size, num_kv_heads, head_dim, device=DEVICE)
    expected = kv_cache.clone()
    slot_mapping = torch.tensor([17, 18, -1, 63, 32], device=DEVICE)
    reference.reshape_and_cache(key, value, expected[1, 0], expected[1, 1], slot_mapping)
    reshape_and_cache_triton(key, value, kv_cache[1, 0], kv_cache[1, 1], slot_mapping)
    assert torch.equal(kv_cache, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize(
    ("num_kv_heads", "head_dim", "block_size"), [(2, 64, 16), (1, 128, 32)], ids=["a", "b"]
)
def test_copy_blocks_matches_reference_for_every_layer_k_and_v(
    dtype: torch.dtype, num_kv_heads: int, head_dim: int, block_size: int
) -> None:
    kv_cache = torch.randn(3, 2, 7, block_size, num_kv_heads, head_dim).to(dtype).to(DEVICE)
    src = torch.tensor([1, 4, 4], device=DEVICE)  # one source forked twice
    dst = torch.tensor([6, 2, 5], device=DEVICE)
    expected = kv_cache.clone()
    reference.copy_blocks(expected, src, dst)
    copy_blocks_triton(kv_cache, src, dst)
    assert torch.equal(kv_cache, expected)


def test_copy_blocks_with_no_pairs_is_a_no_op() -> None:
    kv_cache = torch.randn(1, 2, 3, 16, 1, 16, device=DEVICE)
    before = kv_cache.clone()
    empty = torch.empty(0, dtype=torch.int64, device=DEVICE)
    copy_blocks_triton(kv_cache, empty, empty)
    assert torch.equal(kv_cache, before)


@pytest.mark.usefixtures("force_triton")
def test_ops_forced_triton_cache_ops_match_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*args: object, **kwargs: object) -> None:
        raise AssertionError("reference called although PAGEDSERVE_FORCE_TRITON=1")

    kv_cache = torch.randn(2, 2, 5, 16, 2, 64, device=DEVICE)
    expected = kv_cache.clone()
    key, value = torch.randn(3, 2, 64, device=DEVICE), torch.randn(3, 2, 64, device=DEVICE)
    slot_mapping = torch.tensor([20, -1, 79], device=DEVICE)
    src, dst = torch.tensor([1], device=DEVICE), torch.tensor([3], device=DEVICE)
    reference.reshape_and_cache(key, value, expected[0, 0], expected[0, 1], slot_mapping)
    reference.copy_blocks(expected, src, dst)
    monkeypatch.setattr(reference, "reshape_and_cache", fail)
    monkeypatch.setattr(reference, "copy_blocks", fail)
    ops.reshape_and_cache(key, value, kv_cache[0, 0], kv_cache[0, 1], slot_mapping)
    ops.copy_blocks(kv_cache, src, dst)
    assert torch.equal(kv_cache, expected)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda k, c, s: reshape_and_cache_triton(k, k, c, c, s.float()), r"int64, got torch.f"),
        (lambda k, c, s: reshape_and_cache_triton(k, k.half(), c, c, s), "value dtype"),
        (lambda k, c, s: reshape_and_cache_triton(k[:, :1], k[:, :1], c, c, s), "cache heads"),
        (lambda k, c, s: reshape_and_cache_triton(k, k, c, c, s[:1]), r"\[T\] = \[2\]"),
        (lambda k, c, s: reshape_and_cache_triton(k, k, c.transpose(2, 3), c, s), "both be"),
    ],
    ids=["slot-dtype", "value-dtype", "heads", "slot-len", "cache-shape"],
)
def test_reshape_and_cache_rejects_bad_inputs(call, message: str) -> None:
    key = torch.randn(2, 2, 16)
    cache = torch.randn(3, 16, 2, 16)
    with pytest.raises(ValueError, match=message):
        call(key, cache, torch.tensor([0, 1]))


def test_copy_blocks_rejects_bad_inputs() -> None:
    kv_cache = torch.randn(1, 2, 3, 16, 1, 16)
    ids = torch.tensor([1])
    with pytest.raises(ValueError, match="L, 2, NB"):
        copy_blocks_triton(kv_cache[0], ids, ids)
    with pytest.raises(ValueError, match="src"):
        copy_blocks_triton(kv_cache, ids.float(), ids)
    with pytest.raises(ValueError, match="differ in length"):
        copy_blocks_triton(kv_cache, ids, torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="payload must be contiguous"):
        copy_blocks_triton(kv_cache.transpose(3, 5), ids, torch.tensor([2]))
