"""The fast CPU attention (``kernels/cpu_attention.py``, what ``ops`` serves on the CPU)
against the reference on random paged batches: mixed decode, chunked prefill and prefix
hits, pure decode, batch padding, MHA / GQA / MQA, block sizes 1, 16 and 32."""

from __future__ import annotations

import random

import pytest
import torch

from kernels import ops, reference
from kernels.cpu_attention import paged_attention_cpu
from kernels.testing import MIXED_BATCH, TOLERANCES, make_paged_batch

HEADS = [(4, 4), (8, 2), (8, 1)]  # (query heads, KV heads): MHA, GQA, MQA


def _random_batch(rng: random.Random, num_seqs: int, decode_share: float) -> list[tuple[int, int]]:
    seqs = []
    for _ in range(num_seqs):
        context = rng.choice([0, rng.randint(1, 90)])
        q_len = 1 if rng.random() < decode_share else rng.randint(1, 40)
        seqs.append((context if q_len > 1 or context else rng.randint(1, 90), q_len))
    return seqs


@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize(("num_q_heads", "num_kv_heads"), HEADS, ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("decode_share", [1.0, 0.7], ids=["decode", "mixed"])
def test_fast_cpu_attention_matches_the_reference_on_random_paged_batches(
    block_size: int, num_q_heads: int, num_kv_heads: int, decode_share: float
) -> None:
    rng = random.Random(block_size * 100 + num_kv_heads * 10 + int(decode_share * 10))
    for trial in range(3):
        seqs = _random_batch(rng, rng.randint(1, 12), decode_share)
        batch = make_paged_batch(
            seqs,
            num_q_heads=num_q_heads,
            num_kv_heads=num_kv_heads,
            head_dim=16,
            block_size=block_size,
            num_pad_tokens=trial,  # 0, 1, 2 padding rows
            seed=trial,
        )
        want = reference.paged_attention(*batch.args())
        got = paged_attention_cpu(*batch.args(), **batch.hints())
        torch.testing.assert_close(got, want, **TOLERANCES[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_fast_cpu_attention_computes_in_fp32_and_returns_the_query_dtype(dtype) -> None:
    batch = make_paged_batch(
        MIXED_BATCH, num_q_heads=8, num_kv_heads=2, head_dim=16, block_size=16, dtype=dtype
    )
    want = reference.paged_attention(*batch.args())
    got = paged_attention_cpu(*batch.args())
    assert got.dtype == dtype
    torch.testing.assert_close(got, want, **TOLERANCES[dtype])


def test_ops_serves_cpu_tensors_with_the_fast_path() -> None:
    batch = make_paged_batch(
        MIXED_BATCH, num_q_heads=8, num_kv_heads=2, head_dim=16, block_size=16, num_pad_tokens=2
    )
    out = ops.paged_attention(*batch.args(), **batch.hints())
    torch.testing.assert_close(out, reference.paged_attention(*batch.args()))
    assert ops.cpu_attention_impl() == "fast"


def test_a_query_longer_than_its_context_is_refused_as_by_the_reference() -> None:
    batch = make_paged_batch([(0, 4)], num_q_heads=2, num_kv_heads=1, head_dim=8, block_size=4)
    args = list(batch.args())
    args[5] = torch.tensor([3], dtype=torch.int32)  # seq_lens < query length
    with pytest.raises(ValueError, match="4 query tokens but seq_len=3"):
        paged_attention_cpu(*args)
