"""Sliding-window attention and logit soft-capping in the Triton kernels (unified and
split-KV, under the interpreter on CPU) and in ``pagedserve.kernels.ops`` dispatch, against the
reference (itself checked against a brute-force dense oracle in
``test_kernels_reference.py``).

Windows are chosen against ``WINDOW_BATCH``: 1 (only the token itself), the block size,
one crossing block boundaries, one equal to a sequence's whole context (64) and one
larger than every context. The batch mixes decodes, a fresh prefill, prefill chunks after
cached context (query_len < seq_len) and a long decode whose window starts far into its
context, so the kernels skip whole key tiles.
"""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels import ops, reference
from pagedserve.kernels.paged_attention import paged_attention_triton
from pagedserve.kernels.paged_attention_split_kv import paged_attention_split_kv_triton
from pagedserve.kernels.testing import TOLERANCES, KernelCase, PagedBatch, make_paged_batch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# (context_len, query_len): fresh prefill, decodes, a chunk after a 45-token prefix whose
# last token sees exactly 64 positions, a one-token prompt, a long decode, a long chunk.
WINDOW_BATCH: tuple[tuple[int, int], ...] = (
    (0, 7),
    (37, 1),
    (45, 19),
    (16, 1),
    (0, 1),
    (130, 1),
    (80, 40),
)
WINDOWS = [1, 16, 19, 64, 1000]
WINDOW_IDS = ["w1-self-only", "w16-one-block", "w19-crosses-blocks", "w64-whole-ctx", "w1000"]
# MHA at block size 1 (fp16), GQA 4:1 at block size 16 (fp32), odd group 5:1 (fp16).
CASES = (
    KernelCase(4, 4, 32, 1, torch.float16),
    KernelCase(8, 2, 64, 16, torch.float32),
    KernelCase(5, 1, 64, 16, torch.float16),
)


def _batch(
    case: KernelCase, seqs: tuple[tuple[int, int], ...], num_pad_tokens: int = 2, seed: int = 0
) -> PagedBatch:
    return case.batch(seqs, DEVICE, num_pad_tokens, seed)


def _assert_matches_reference(
    out: torch.Tensor,
    batch: PagedBatch,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> None:
    expected = reference.paged_attention(
        *(a.cpu() if torch.is_tensor(a) else a for a in batch.args()),
        sliding_window=sliding_window,
        logits_soft_cap=logits_soft_cap,
    )
    assert out.dtype == batch.query.dtype
    assert out.shape == batch.query.shape
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.cpu().float(), expected.float(), **TOLERANCES[out.dtype])


@pytest.mark.parametrize("window", WINDOWS, ids=WINDOW_IDS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_unified_sliding_window_mixed_batch_matches_reference(
    case: KernelCase, window: int
) -> None:
    batch = _batch(case, WINDOW_BATCH)
    out = paged_attention_triton(*batch.args(), **batch.hints(), sliding_window=window)
    _assert_matches_reference(out, batch, sliding_window=window)
    assert torch.equal(out[-2:], torch.zeros_like(out[-2:]))  # padding rows


def test_unified_sliding_window_pure_decode_tiles_match_reference() -> None:
    """max_query_len=1 selects the decode tiles (several group heads, one token)."""
    batch = _batch(CASES[1], ((1, 1), (40, 1), (63, 1), (64, 1), (200, 1)))
    out = paged_attention_triton(*batch.args(), **batch.hints(), sliding_window=24)
    _assert_matches_reference(out, batch, sliding_window=24)


@pytest.mark.parametrize("window", [5, 64, 1000], ids=["w5", "w64", "w1000"])
@pytest.mark.parametrize("num_splits", [3, 8])
def test_split_kv_sliding_window_decode_with_splits_outside_the_window(
    num_splits: int, window: int
) -> None:
    """Splits cut each row's window span; with an oversized ``max_seq_len`` hint most
    splits hold no visible key (past the context, or before the window) and must give
    the neutral partial (lse = -inf, zero output) that the merge ignores."""
    batch = _batch(CASES[1], ((3, 1), (150, 1), (70, 1), (300, 1), (63, 1)))
    out = paged_attention_split_kv_triton(
        *batch.args(),
        num_splits=num_splits,
        max_query_len=1,
        max_seq_len=1000,
        sliding_window=window,
    )
    _assert_matches_reference(out, batch, sliding_window=window)
    assert torch.equal(out[-2:], torch.zeros_like(out[-2:]))  # padding rows


def test_split_kv_sliding_window_mixed_batch_block_size_one_matches_reference() -> None:
    """Prefill tiles: a split can be non-empty yet wholly before some rows' windows (e.g.
    row at position 111 of the (80, 40) chunk with W=19 sees nothing in [0, 64))."""
    batch = _batch(CASES[0], WINDOW_BATCH)
    out = paged_attention_split_kv_triton(
        *batch.args(), num_splits=4, **batch.hints(), sliding_window=19
    )
    _assert_matches_reference(out, batch, sliding_window=19)


@pytest.mark.parametrize(
    ("window", "soft_cap"),
    [(None, 1.5), (19, 1.5), (None, 30.0)],
    ids=["cap1.5", "w19-cap1.5", "cap30"],
)
def test_unified_logits_soft_cap_alone_and_with_window_matches_reference(
    window: int | None, soft_cap: float
) -> None:
    batch = _batch(CASES[2], WINDOW_BATCH)
    out = paged_attention_triton(
        *batch.args(), **batch.hints(), sliding_window=window, logits_soft_cap=soft_cap
    )
    _assert_matches_reference(out, batch, sliding_window=window, logits_soft_cap=soft_cap)


@pytest.mark.parametrize(("window", "soft_cap"), [(None, 1.5), (40, 1.5)], ids=["cap", "w40-cap"])
def test_split_kv_logits_soft_cap_alone_and_with_window_matches_reference(
    window: int | None, soft_cap: float
) -> None:
    batch = _batch(CASES[1], ((3, 1), (150, 1), (70, 1)))
    out = paged_attention_split_kv_triton(
        *batch.args(),
        num_splits=4,
        **batch.hints(),
        sliding_window=window,
        logits_soft_cap=soft_cap,
    )
    _assert_matches_reference(out, batch, sliding_window=window, logits_soft_cap=soft_cap)


def test_soft_cap_changes_the_result_and_a_window_past_the_context_does_not() -> None:
    """Guards the tests above against options that are silently ignored."""
    batch = _batch(CASES[1], ((45, 19), (130, 1)))
    full = paged_attention_triton(*batch.args(), **batch.hints())
    wide = paged_attention_triton(*batch.args(), **batch.hints(), sliding_window=131)
    torch.testing.assert_close(wide, full, atol=0.0, rtol=0.0)
    narrow = paged_attention_triton(*batch.args(), **batch.hints(), sliding_window=8)
    capped = paged_attention_triton(*batch.args(), **batch.hints(), logits_soft_cap=0.5)
    assert (narrow - full).abs().max() > 0.05
    assert (capped - full).abs().max() > 0.05


def _poison_blocks_before_windows(batch: PagedBatch, window: int) -> int:
    """Fill with NaN every cache block that lies wholly before all windows of its
    sequence's query tokens, plus block 0 and the unowned blocks; return how many of the
    sequences' own blocks were poisoned."""
    block_size = batch.key_cache.shape[1]
    starts = batch.query_start_loc.tolist()
    owned: set[int] = set()
    poisoned = 0
    for b, seq_len in enumerate(batch.seq_lens.tolist()):
        num_blocks = -(-seq_len // block_size)
        table = batch.block_tables[b, :num_blocks].tolist()
        owned.update(table)
        first_q_pos = seq_len - (starts[b + 1] - starts[b])
        first_needed_block = max(0, first_q_pos - window + 1) // block_size
        for block in table[:first_needed_block]:
            batch.key_cache[block] = float("nan")
            batch.value_cache[block] = float("nan")
            poisoned += 1
    for block in set(range(batch.key_cache.shape[0])) - owned:
        batch.key_cache[block] = float("nan")
        batch.value_cache[block] = float("nan")
    return poisoned


@pytest.mark.parametrize("path", ["unified", "split_kv", "fast_cpu"])
def test_blocks_wholly_before_the_window_are_never_read(path: str) -> None:
    """A window's point: KV blocks before it are skipped (a block manager may free
    them). NaN there must not reach the output, whichever path serves the batch."""
    window = 19
    case = CASES[1]
    batch = _batch(case, WINDOW_BATCH)
    expected = reference.paged_attention(*batch.args(), sliding_window=window)
    assert _poison_blocks_before_windows(batch, window) >= 8
    if path == "unified":
        out = paged_attention_triton(*batch.args(), **batch.hints(), sliding_window=window)
    elif path == "split_kv":
        out = paged_attention_split_kv_triton(
            *batch.args(), num_splits=3, **batch.hints(), sliding_window=window
        )
    else:
        out = ops.paged_attention(*batch.args(), **batch.hints(), sliding_window=window)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, expected, **TOLERANCES[case.dtype])


@pytest.mark.usefixtures("force_triton")
def test_ops_threads_window_and_soft_cap_to_the_kernel_it_picks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A long decode splits without a window; with a short one the heuristic sees the
    effective context min(max_seq_len, W) and keeps the unified kernel."""
    import pagedserve.kernels.paged_attention as unified_module
    import pagedserve.kernels.paged_attention_split_kv as split_module

    calls: list[tuple[str, object, object]] = []
    for module, name in (
        (unified_module, "paged_attention_triton"),
        (split_module, "paged_attention_split_kv_triton"),
    ):
        real = getattr(module, name)

        def spy(*args: object, _real=real, _name=name, **kwargs: object) -> torch.Tensor:
            calls.append((_name, kwargs["sliding_window"], kwargs["logits_soft_cap"]))
            return _real(*args, **kwargs)

        monkeypatch.setattr(module, name, spy)
    long_decode = _batch(CASES[1], ((600, 1),), num_pad_tokens=0)
    for window, soft_cap in ((None, 2.0), (700, 2.0), (100, None)):
        out = ops.paged_attention(
            *long_decode.args(),
            **long_decode.hints(),
            sliding_window=window,
            logits_soft_cap=soft_cap,
        )
        _assert_matches_reference(out, long_decode, window, soft_cap)
    assert calls == [
        ("paged_attention_split_kv_triton", None, 2.0),
        ("paged_attention_split_kv_triton", 700, 2.0),
        ("paged_attention_triton", 100, None),
    ]


@pytest.mark.parametrize(
    ("window", "soft_cap", "message"),
    [(-1, None, "sliding_window"), (None, -2.0, "logits_soft_cap")],
    ids=["negative-window", "negative-cap"],
)
def test_every_attention_path_refuses_a_negative_window_or_cap(
    window: int | None, soft_cap: float | None, message: str
) -> None:
    batch = make_paged_batch(((3, 2),), num_q_heads=4, num_kv_heads=2, head_dim=16, block_size=16)
    for launcher in (
        paged_attention_triton,
        paged_attention_split_kv_triton,
        reference.paged_attention,
        ops.paged_attention,
    ):
        with pytest.raises(ValueError, match=message):
            launcher(*batch.args(), sliding_window=window, logits_soft_cap=soft_cap)


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [0, 4], ids=["unified", "split4"])
def test_bf16_sliding_window_and_soft_cap_on_cuda_match_reference(num_splits: int) -> None:
    case = KernelCase(8, 2, 128, 16, torch.bfloat16)
    batch = _batch(case, WINDOW_BATCH)
    options = {"sliding_window": 19, "logits_soft_cap": 30.0}
    if num_splits:
        out = paged_attention_split_kv_triton(
            *batch.args(), num_splits=num_splits, **batch.hints(), **options
        )
    else:
        out = paged_attention_triton(*batch.args(), **batch.hints(), **options)
    _assert_matches_reference(out, batch, **options)
