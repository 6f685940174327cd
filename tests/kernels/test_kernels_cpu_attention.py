"""The fast CPU attention (``pagedserve/kernels/cpu_attention.py``, what ``ops`` serves on the CPU)
against the reference on random paged batches: mixed decode, chunked prefill and prefix
hits, pure decode, batch padding, MHA / GQA / MQA, block sizes 1, 16 and 32. Each test runs
twice: decode rows on the native kernel (where it is built) and on the torch path."""

from __future__ import annotations

import random

import pytest
import torch

from pagedserve.kernels import cpu_attention, ops, reference
from pagedserve.kernels.cpu_attention import decode_buckets, paged_attention_cpu
from pagedserve.kernels.cpu_native import NATIVE_ENV
from pagedserve.kernels.testing import MIXED_BATCH, TOLERANCES, make_paged_batch

HEADS = [(4, 4), (8, 2), (8, 1)]  # (query heads, KV heads): MHA, GQA, MQA
# Tests of the torch decode path's own buckets: run once, on the torch path.
TORCH_DECODE_ONLY = (
    "test_fast_cpu_decode_split_into_buckets_matches_the_reference",
    "test_short_query_rows_split_into_buckets_match_the_reference",
)


@pytest.fixture(autouse=True, params=["native", "torch"])
def decode_rows_on(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Decode rows on the native kernel (the default where it builds) or on torch."""
    if request.param == "torch":
        monkeypatch.setenv(NATIVE_ENV, "0")
    elif request.node.originalname in TORCH_DECODE_ONLY:
        pytest.skip("a test of the torch decode path's buckets")
    return str(request.param)


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


def _check_against_reference(
    seqs: list[tuple[int, int]],
    heads: tuple[int, int],
    block_size: int,
    trial: int,
    window: int | None,
    soft_cap: float | None,
) -> None:
    """The fast path equals the reference on a batch of ``seqs`` (context, query length),
    ``trial`` padding rows, with the given window and soft-cap."""
    batch = make_paged_batch(
        seqs,
        num_q_heads=heads[0],
        num_kv_heads=heads[1],
        head_dim=16,
        block_size=block_size,
        num_pad_tokens=trial,
        seed=trial,
    )
    options = {"sliding_window": window, "logits_soft_cap": soft_cap}
    want = reference.paged_attention(*batch.args(), **options)
    got = paged_attention_cpu(*batch.args(), **batch.hints(), **options)
    torch.testing.assert_close(got, want, **TOLERANCES[torch.float32])


@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize(("num_q_heads", "num_kv_heads"), HEADS[1:], ids=["gqa", "mqa"])
@pytest.mark.parametrize("decode_share", [1.0, 0.6], ids=["decode", "mixed"])
@pytest.mark.parametrize(
    ("window", "soft_cap"),
    [(1, None), (5, None), (16, None), (33, 2.0), (None, 2.0), (500, None)],
    ids=["w1", "w5", "w16", "w33-cap2", "cap2", "w500"],
)
def test_fast_cpu_attention_with_window_and_soft_cap_matches_the_reference(
    block_size: int,
    num_q_heads: int,
    num_kv_heads: int,
    decode_share: float,
    window: int | None,
    soft_cap: float | None,
) -> None:
    """Windows smaller than, crossing and larger than the blocks and contexts (up to 130
    positions), soft-cap alone and with a window, on random decode / chunked-prefill /
    prefix-hit batches."""
    rng = random.Random(block_size * 1000 + num_kv_heads * 100 + (window or 0))
    for trial in range(2):
        seqs = _random_batch(rng, rng.randint(1, 10), decode_share)
        seqs.append((rng.randint(60, 90), 1 if decode_share == 1.0 else 40))  # a long one
        heads = (num_q_heads, num_kv_heads)
        _check_against_reference(seqs, heads, block_size, trial, window, soft_cap)


@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize(("num_q_heads", "num_kv_heads"), HEADS, ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize(
    ("window", "soft_cap"),
    [(None, None), (3, None), (20, 2.0), (None, 2.0)],
    ids=["full", "w3", "w20-cap2", "cap2"],
)
def test_short_query_rows_are_batched_and_match_the_reference(
    block_size: int,
    num_q_heads: int,
    num_kv_heads: int,
    window: int | None,
    soft_cap: float | None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Verification-shaped steps (k + 1 query tokens after a context, some sequences with
    fewer drafts, some decoding one token, a longer chunk beside them; windows shorter than
    the query rows): rows of 2 .. MAX_BATCHED_QUERY tokens that share their length with
    another take the batched path, not the per-sequence prefill call, and every token sees
    exactly its own causal window."""
    prefills: list[int] = []
    real_prefill = cpu_attention._prefill

    def counting_prefill(query: torch.Tensor, *args: object) -> torch.Tensor:
        prefills.append(query.shape[0])
        return real_prefill(query, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(cpu_attention, "_prefill", counting_prefill)
    rng = random.Random(block_size * 100 + num_kv_heads * 10 + (window or 0))
    for trial in range(3):
        seqs = [(rng.randint(0, 70), q) for q in (1, 1, 2, 2, 5, 5, 5, 16, 16)]
        seqs += [(0, 5), (rng.randint(1, 40), 3), (rng.randint(1, 40), 17), (800, 5)]
        rng.shuffle(seqs)  # the 3-token row alone of its length; the 17, the 805 past the cuts
        heads = (num_q_heads, num_kv_heads)
        _check_against_reference(seqs, heads, block_size, trial, window, soft_cap)
    # Only the chunk longer than MAX_BATCHED_QUERY, the row over a context past
    # MAX_BATCHED_CONTEXT, and a row alone of its length (one call either way).
    assert sorted(prefills) == [3, 3, 3, 5, 5, 5, 17, 17, 17]
    assert (cpu_attention.MAX_BATCHED_QUERY, cpu_attention.MAX_BATCHED_CONTEXT) == (16, 768)


def test_short_query_rows_split_into_buckets_match_the_reference(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Rows of k + 1 queries over very different contexts go in different buckets (one row
    each here), and their outputs land back on their own query tokens."""
    monkeypatch.setattr(cpu_attention, "SPLIT_BYTES", 1)
    seqs = [(90, 5), (3, 5), (40, 5), (0, 5), (61, 5)]
    batch = make_paged_batch(seqs, num_q_heads=8, num_kv_heads=2, head_dim=16, block_size=4)
    for window in (None, 7):
        want = reference.paged_attention(*batch.args(), sliding_window=window)
        got = paged_attention_cpu(*batch.args(), **batch.hints(), sliding_window=window)
        torch.testing.assert_close(got, want, **TOLERANCES[torch.float32])


def test_fast_cpu_decode_with_window_gathers_only_the_window_blocks() -> None:
    """Each decode row gathers from the block holding its window's first key: a row
    whose earlier blocks point at a nonexistent block still works (they are not read)."""
    batch = make_paged_batch(
        [(300, 1), (40, 1), (95, 1)], num_q_heads=4, num_kv_heads=2, head_dim=16, block_size=16
    )
    want = reference.paged_attention(*batch.args(), sliding_window=20)
    batch.block_tables[0, :17] = 10**6  # row 0 (position 300) needs blocks 17 and 18 only
    batch.block_tables[2, :4] = 10**6  # row 2 (position 95) needs blocks 4 and 5 only
    got = paged_attention_cpu(*batch.args(), sliding_window=20)
    torch.testing.assert_close(got, want, **TOLERANCES[torch.float32])


def test_decode_buckets_cut_rows_where_padding_would_cost_more_than_a_bucket() -> None:
    assert decode_buckets([5] * 40, split=4, cap=10**6) == [40]  # equal lengths: one
    assert decode_buckets([1, 1, 1, 20, 20], split=4, cap=10**6) == [3, 5]
    assert decode_buckets([1, 2, 3, 4], split=100, cap=10**6) == [4]
    # The cap bounds the blocks one bucket gathers, even without padding.
    assert decode_buckets([4] * 10, split=100, cap=12) == [3, 6, 9, 10]
    # Every row lands in exactly one bucket, in order.
    rng = random.Random(0)
    blocks = sorted(rng.randint(1, 30) for _ in range(200))
    ends = decode_buckets(blocks, split=8, cap=400)
    assert ends == sorted(set(ends)) and ends[-1] == 200 and ends[0] > 0
    start = 0
    for end in ends:
        rows = blocks[start:end]
        assert len(rows) * rows[-1] - sum(rows) <= 8
        start = end


@pytest.mark.parametrize("window", [None, 24], ids=["full", "window"])
@pytest.mark.parametrize(("num_q_heads", "num_kv_heads"), HEADS, ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize(("split", "cap"), [(1, 1), (3, 40)], ids=["one-row-each", "mixed"])
def test_fast_cpu_decode_split_into_buckets_matches_the_reference(
    monkeypatch: pytest.MonkeyPatch,
    window: int | None,
    num_q_heads: int,
    num_kv_heads: int,
    split: int,
    cap: int,
) -> None:
    """Thresholds in blocks: one block (every row its own bucket), or buckets of several
    rows of different lengths beside others; rows permuted back to their places, decode
    rows mixed with prefill chunks and padding."""
    block_bytes = 2 * 8 * num_kv_heads * 16 * 4  # K + V of a block: BS 8, D 16, fp32
    monkeypatch.setattr(cpu_attention, "SPLIT_BYTES", split * block_bytes)
    monkeypatch.setattr(cpu_attention, "MAX_BUCKET_BYTES", cap * block_bytes)
    sizes: list[int] = []
    cut = cpu_attention.decode_buckets

    def recorded(blocks: list[int], s: int, c: int) -> list[int]:
        ends = cut(blocks, s, c)
        sizes.extend(b - a for a, b in zip([0, *ends[:-1]], ends, strict=True))
        return ends

    monkeypatch.setattr(cpu_attention, "decode_buckets", recorded)
    rng = random.Random(7)
    seqs = [(rng.randint(1, 120), 1) for _ in range(14)] + [(30, 9), (0, 5)]
    rng.shuffle(seqs)
    batch = make_paged_batch(
        seqs,
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_dim=16,
        block_size=8,
        num_pad_tokens=1,
    )
    options = {"sliding_window": window}
    want = reference.paged_attention(*batch.args(), **options)
    got = paged_attention_cpu(*batch.args(), **batch.hints(), **options)
    torch.testing.assert_close(got, want, **TOLERANCES[torch.float32])
    assert len(sizes) > 1 and sum(sizes) == 14  # the 9- and 5-token rows: one call each
    if split > 1:
        assert max(sizes) > 1
