"""Triton paged attention (unified and split-KV) against the torch reference.

On CPU the kernels run under the Triton interpreter. The matrix is the pairwise
covering array ``PAIRWISE_CASES`` (GQA 4:4 / 8:2 / 5:1 x head_dim 64 / 128 x block size
16 / 32 x fp32 / fp16) on ``MIXED_BATCH`` (decode tokens, fresh prefill, prefill after a
cached prefix, lengths off block boundaries, batch padding rows), plus targeted cases.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedserve.kernels import ops, reference
from pagedserve.kernels.paged_attention import paged_attention_triton
from pagedserve.kernels.paged_attention_split_kv import paged_attention_split_kv_triton
from pagedserve.kernels.testing import (
    MIXED_BATCH,
    PAIRWISE_CASES,
    TOLERANCES,
    KernelCase,
    PagedBatch,
    make_paged_batch,
)
from tests.hypothesis_budget import examples

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _batch(
    case: KernelCase, seqs: tuple[tuple[int, int], ...], num_pad_tokens: int = 2, seed: int = 0
) -> PagedBatch:
    return case.batch(seqs, DEVICE, num_pad_tokens, seed)


def _assert_matches_reference(out: torch.Tensor, batch: PagedBatch) -> None:
    expected = reference.paged_attention(
        *(a.cpu() if torch.is_tensor(a) else a for a in batch.args())
    )
    assert out.dtype == batch.query.dtype
    assert out.shape == batch.query.shape
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.cpu().float(), expected.float(), **TOLERANCES[out.dtype])


@pytest.mark.parametrize("case", PAIRWISE_CASES, ids=lambda c: c.id)
def test_unified_mixed_batch_matches_reference(case: KernelCase) -> None:
    batch = _batch(case, MIXED_BATCH)
    out = paged_attention_triton(*batch.args(), **batch.hints())
    _assert_matches_reference(out, batch)
    assert torch.equal(out[-2:], torch.zeros_like(out[-2:]))  # padding rows


@pytest.mark.parametrize("case", PAIRWISE_CASES[::2], ids=lambda c: c.id)
def test_unified_pure_decode_batch_with_decode_tiles_matches_reference(case: KernelCase) -> None:
    """max_query_len=1 selects the small decode query tiles."""
    batch = _batch(case, ((1, 1), (40, 1), (63, 1), (64, 1), (100, 1)))
    out = paged_attention_triton(*batch.args(), max_query_len=1, max_seq_len=batch.max_seq_len)
    _assert_matches_reference(out, batch)


def test_unified_without_host_hints_matches_reference() -> None:
    batch = _batch(PAIRWISE_CASES[3], MIXED_BATCH)
    _assert_matches_reference(paged_attention_triton(*batch.args()), batch)


@pytest.mark.parametrize("case", PAIRWISE_CASES[1::2], ids=lambda c: c.id)
@pytest.mark.parametrize("num_splits", [1, 3, 8])
def test_split_kv_decode_batch_matches_reference(case: KernelCase, num_splits: int) -> None:
    """Short and long contexts together: the short ones leave most splits empty."""
    batch = _batch(case, ((3, 1), (150, 1), (70, 1)))
    out = paged_attention_split_kv_triton(*batch.args(), num_splits=num_splits, **batch.hints())
    _assert_matches_reference(out, batch)
    assert torch.equal(out[-2:], torch.zeros_like(out[-2:]))  # padding rows


def test_split_kv_mixed_batch_without_hints_matches_reference() -> None:
    """Exact for prefill rows too; without max_seq_len the block table bounds the splits."""
    batch = _batch(PAIRWISE_CASES[2], MIXED_BATCH)
    out = paged_attention_split_kv_triton(*batch.args(), num_splits=4)
    _assert_matches_reference(out, batch)


@pytest.mark.parametrize("head_dim", [24, 80], ids=lambda d: f"d{d}")
def test_non_power_of_two_head_dim_is_padded_and_masked(head_dim: int) -> None:
    case = KernelCase(4, 2, head_dim, 16, torch.float32)
    batch = _batch(case, ((20, 1), (9, 5)))
    _assert_matches_reference(paged_attention_triton(*batch.args(), **batch.hints()), batch)
    out = paged_attention_split_kv_triton(*batch.args(), num_splits=2, **batch.hints())
    _assert_matches_reference(out, batch)


def test_padding_rows_are_zero_not_nan_even_with_garbage_queries() -> None:
    case = PAIRWISE_CASES[0]
    batch = _batch(case, ((5, 3),), num_pad_tokens=4)
    batch.query[-4:] = float("nan")
    for out in (
        paged_attention_triton(*batch.args(), **batch.hints()),
        paged_attention_split_kv_triton(*batch.args(), num_splits=2, **batch.hints()),
    ):
        assert torch.equal(out[-4:], torch.zeros_like(out[-4:]))
        assert torch.isfinite(out).all()


def test_sequences_without_query_tokens_are_skipped() -> None:
    """A sequence with q_len 0 (e.g. waiting on a chunk) contributes no rows."""
    case = PAIRWISE_CASES[2]
    batch = _batch(case, ((10, 2), (30, 0), (4, 3)))
    _assert_matches_reference(paged_attention_triton(*batch.args(), **batch.hints()), batch)


def test_split_with_empty_ranges_writes_zero_for_rows_that_see_no_key() -> None:
    """A row whose keys all fall in other splits gets lse=-inf there; merge stays finite.

    Forcing split_len (via a max_seq_len hint larger than the context) so that whole
    splits are empty for every row checks the -inf handling end to end.
    """
    case = PAIRWISE_CASES[0]
    batch = _batch(case, ((2, 1), (0, 3)))
    out = paged_attention_split_kv_triton(
        *batch.args(), num_splits=4, max_query_len=3, max_seq_len=1000
    )
    _assert_matches_reference(out, batch)


@settings(max_examples=examples(6), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seqs=st.lists(st.tuples(st.integers(0, 70), st.integers(0, 9)), min_size=1, max_size=4).filter(
        lambda s: any(q > 0 for _, q in s)
    ),
    num_pad_tokens=st.integers(0, 3),
    seed=st.integers(0, 2**16),
)
def test_random_batches_unified_and_split_kv_match_reference(
    seqs: list[tuple[int, int]], num_pad_tokens: int, seed: int
) -> None:
    case = KernelCase(6, 2, 32, 16, torch.float32)
    batch = _batch(case, tuple(seqs), num_pad_tokens=num_pad_tokens, seed=seed)
    _assert_matches_reference(paged_attention_triton(*batch.args(), **batch.hints()), batch)
    out = paged_attention_split_kv_triton(*batch.args(), num_splits=3, **batch.hints())
    _assert_matches_reference(out, batch)


# ---------------------------------------------------------------- dispatch and heuristic


@pytest.mark.parametrize(("env", "expected"), [(None, "fast"), ("reference", "reference")])
def test_ops_dispatches_cpu_tensors_to_the_fast_path_or_the_reference_on_request(
    monkeypatch: pytest.MonkeyPatch, env: str | None, expected: str
) -> None:
    monkeypatch.delenv("PAGEDSERVE_FORCE_TRITON", raising=False)
    if env is None:
        monkeypatch.delenv(ops.CPU_ATTENTION_ENV, raising=False)
    else:
        monkeypatch.setenv(ops.CPU_ATTENTION_ENV, env)
    batch = make_paged_batch(MIXED_BATCH, num_q_heads=4, num_kv_heads=2, head_dim=16, block_size=16)
    calls: list[str] = []

    def spy(name: str) -> Any:
        real = ops._CPU_ATTENTION[name]

        def call(*args: Any, **kwargs: Any) -> torch.Tensor:
            calls.append(name)
            return real(*args, **kwargs)

        return call

    monkeypatch.setattr(ops, "_CPU_ATTENTION", {n: spy(n) for n in ops._CPU_ATTENTION})
    ops.paged_attention(*batch.args())
    assert calls == [expected]


def test_an_unknown_cpu_attention_is_refused_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(ops.CPU_ATTENTION_ENV, "turbo")
    with pytest.raises(ValueError, match=ops.CPU_ATTENTION_ENV):
        ops.cpu_attention_impl()


@pytest.mark.usefixtures("force_triton")
def test_ops_forced_triton_uses_split_kv_for_one_long_decode(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import pagedserve.kernels.paged_attention as unified_module
    import pagedserve.kernels.paged_attention_split_kv as split_module

    calls: list[str] = []
    for module, name in (
        (unified_module, "paged_attention_triton"),
        (split_module, "paged_attention_split_kv_triton"),
    ):
        real = getattr(module, name)

        def spy(*args: object, _real=real, _name=name, **kwargs: object) -> torch.Tensor:
            calls.append(_name)
            return _real(*args, **kwargs)

        monkeypatch.setattr(module, name, spy)
    long_decode = _batch(PAIRWISE_CASES[0], ((600, 1),), num_pad_tokens=0)
    _assert_matches_reference(ops.paged_attention(*long_decode.args()), long_decode)
    mixed = _batch(PAIRWISE_CASES[0], MIXED_BATCH)
    _assert_matches_reference(ops.paged_attention(*mixed.args(), **mixed.hints()), mixed)
    assert calls == ["paged_attention_split_kv_triton", "paged_attention_triton"]


def test_split_kv_heuristic_splits_only_small_long_decode_batches() -> None:
    h = ops.split_kv_heuristic
    # Plenty of (sequence, kv head) programs: unified.
    assert h(num_seqs=64, num_kv_heads=8, max_query_len=1, max_seq_len=4096, num_sms=132) == 1
    # Any prefill token: unified.
    assert h(num_seqs=1, num_kv_heads=8, max_query_len=2, max_seq_len=16384, num_sms=132) == 1
    # Short context: splitting would not pay for the merge.
    assert h(num_seqs=1, num_kv_heads=8, max_query_len=1, max_seq_len=300, num_sms=132) == 1
    # Few long sequences: split to about two programs per SM, a power of two.
    assert h(num_seqs=16, num_kv_heads=8, max_query_len=1, max_seq_len=4096, num_sms=132) == 4
    assert h(num_seqs=1, num_kv_heads=8, max_query_len=1, max_seq_len=4096, num_sms=132) == 16
    assert h(num_seqs=1, num_kv_heads=8, max_query_len=1, max_seq_len=1 << 20, num_sms=132) == 64


@pytest.mark.parametrize("num_seqs", [1, 2, 5, 16, 40, 100])
@pytest.mark.parametrize("max_seq_len", [256, 1000, 5000, 100_000])
def test_split_kv_heuristic_keeps_splits_long_and_bounded(num_seqs: int, max_seq_len: int) -> None:
    n = ops.split_kv_heuristic(num_seqs, 8, 1, max_seq_len, num_sms=132)
    assert n & (n - 1) == 0 and 1 <= n <= 64
    assert n == 1 or max_seq_len // n >= 256


# ------------------------------------------------------------------------ input checks


def _valid() -> PagedBatch:
    return make_paged_batch(((3, 2),), num_q_heads=4, num_kv_heads=2, head_dim=16, block_size=16)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda b: setattr(b, "query", b.query[:, :3]), "multiple of num_kv_heads"),
        (lambda b: setattr(b, "query", b.query.half()), "dtype"),
        (lambda b: setattr(b, "block_tables", b.block_tables.float()), "block_tables"),
        (lambda b: setattr(b, "seq_lens", b.seq_lens[:0]), "seq_lens"),
        (lambda b: setattr(b, "query_start_loc", b.query_start_loc[:1]), "query_start_loc"),
        (lambda b: setattr(b, "value_cache", b.value_cache[:, :8]), "value_cache shape"),
        (
            lambda b: setattr(b, "query", b.query.transpose(1, 2).contiguous().transpose(1, 2)),
            "contiguous in head_dim",
        ),
        (lambda b: setattr(b, "key_cache", b.key_cache.double()), "dtype"),
    ],
    ids=["heads", "q-dtype", "bt-dtype", "seq-lens", "qsl", "cache-shape", "stride", "kc-dtype"],
)
def test_attention_launchers_reject_bad_inputs_with_clear_errors(mutate, message: str) -> None:
    for launcher in (paged_attention_triton, paged_attention_split_kv_triton):
        batch = _valid()
        mutate(batch)
        with pytest.raises(ValueError, match=message):
            launcher(*batch.args())


@pytest.mark.gpu
@pytest.mark.parametrize("case", PAIRWISE_CASES, ids=lambda c: c.id)
@pytest.mark.parametrize("num_splits", [0, 4], ids=["unified", "split4"])
def test_bf16_on_cuda_matches_reference(case: KernelCase, num_splits: int) -> None:
    bf16 = KernelCase(
        case.num_q_heads, case.num_kv_heads, case.head_dim, case.block_size, torch.bfloat16
    )
    batch = _batch(bf16, MIXED_BATCH)
    if num_splits:
        out = paged_attention_split_kv_triton(*batch.args(), num_splits=num_splits, **batch.hints())
    else:
        out = paged_attention_triton(*batch.args(), **batch.hints())
    _assert_matches_reference(out, batch)
