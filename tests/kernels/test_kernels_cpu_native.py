"""The native CPU decode-attention kernel (``pagedserve/kernels/csrc/cpu_decode_attention.c``,
built by ``pagedserve/kernels/cpu_native.py``) against the reference: cache dtypes, head
sizes, query-head groups wider than one pass, block sizes, windows and soft-caps; its
refusals; and the build's cache and fallbacks."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch

from pagedserve.kernels import cpu_native, reference
from pagedserve.kernels.cpu_attention import paged_attention_cpu
from pagedserve.kernels.cpu_decode_native import decode_attention_native
from pagedserve.kernels.testing import TOLERANCES, make_paged_batch

pytestmark = pytest.mark.skipif(
    cpu_native.load("cpu_decode_attention") is None,
    reason="no C compiler here: the native CPU kernel cannot be built",
)


def _decode_batch(
    seed: int, num_q_heads: int, num_kv_heads: int, head_dim: int, block_size: int, dtype
):
    rng = random.Random(seed)
    seqs = [(rng.randint(0, 140), 1) for _ in range(rng.randint(1, 9))]
    return make_paged_batch(
        seqs,
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        seed=seed,
    )


def _native(batch, window: int = 0, soft_cap: float = 0.0) -> torch.Tensor:
    query, key_cache, value_cache, tables, _, lens, scale = batch.args()
    out = decode_attention_native(
        query, key_cache, value_cache, tables, lens, scale, window, soft_cap
    )
    assert out is not None, "the kernel applies to this batch"
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 128, 80, 256, 8])
@pytest.mark.parametrize(
    ("num_q_heads", "num_kv_heads"), [(4, 4), (8, 2), (32, 1)], ids=["mha", "gqa", "g32"]
)
def test_native_decode_equals_the_reference(dtype, head_dim, num_q_heads, num_kv_heads) -> None:
    """Every cache dtype read in place (fp32 math), the head sizes it specialises (64, 128)
    and others, and a group of 32 query heads per KV head (two passes over K/V)."""
    for seed in range(2):
        batch = _decode_batch(seed, num_q_heads, num_kv_heads, head_dim, 16, dtype)
        want = reference.paged_attention(*batch.args()).float()
        torch.testing.assert_close(_native(batch), want, **TOLERANCES[dtype])


@pytest.mark.parametrize("block_size", [1, 8, 32])
@pytest.mark.parametrize(
    ("window", "soft_cap"),
    [(0, 0.0), (1, 0.0), (7, 0.0), (40, 0.0), (0, 2.0), (23, 5.0)],
    ids=["full", "w1", "w7", "w40", "cap2", "w23-cap5"],
)
def test_native_decode_honours_windows_and_soft_caps(
    block_size: int, window: int, soft_cap: float
) -> None:
    batch = _decode_batch(block_size + window, 8, 2, 64, block_size, torch.float32)
    want = reference.paged_attention(
        *batch.args(), sliding_window=window or None, logits_soft_cap=soft_cap or None
    )
    torch.testing.assert_close(_native(batch, window, soft_cap), want, **TOLERANCES[torch.float32])


def test_native_decode_reads_only_visible_blocks_and_refuses_one_outside_the_cache() -> None:
    batch = make_paged_batch(
        [(300, 1), (40, 1)], num_q_heads=4, num_kv_heads=2, head_dim=16, block_size=16
    )
    want = reference.paged_attention(*batch.args(), sliding_window=20)
    batch.block_tables[0, :17] = 10**6  # position 300 with a window of 20: blocks 17 and 18
    batch.block_tables[1, 0] = -5  # position 40: blocks 1 and 2
    torch.testing.assert_close(_native(batch, window=20), want, **TOLERANCES[torch.float32])
    batch.block_tables[1, 2] = batch.key_cache.shape[0]  # one past the last block
    with pytest.raises(IndexError, match="outside the cache"):
        _native(batch, window=20)


def test_native_decode_declines_what_it_does_not_read_and_the_fast_path_still_answers() -> None:
    """fp8 and int8-record caches (dequantized by the torch path), and an empty batch."""
    batch = _decode_batch(3, 8, 2, 64, 16, torch.float32)
    query, key_cache, value_cache, tables, qsl, lens, scale = batch.args()
    fp8 = key_cache.to(torch.float8_e4m3fn), value_cache.to(torch.float8_e4m3fn)
    assert decode_attention_native(query, *fp8, tables, lens, scale, 0, 0.0) is None
    got = paged_attention_cpu(query, *fp8, tables, qsl, lens, scale)
    want = reference.paged_attention(query, *fp8, tables, qsl, lens, scale)
    torch.testing.assert_close(got, want)
    empty = decode_attention_native(
        query[:0], key_cache, value_cache, tables[:0], lens[:0], scale, 0, 0.0
    )
    assert empty is not None and empty.shape == (0, 8, 64)


def test_the_fast_path_sends_decode_rows_to_the_native_kernel(monkeypatch) -> None:
    from pagedserve.kernels import cpu_attention

    calls: list[int] = []
    real = cpu_attention.decode_attention_native

    def counted(query: torch.Tensor, *args: object):  # type: ignore[no-untyped-def]
        calls.append(query.shape[0])
        return real(query, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(cpu_attention, "decode_attention_native", counted)
    batch = make_paged_batch(
        [(37, 1), (0, 7), (16, 1)], num_q_heads=8, num_kv_heads=2, head_dim=16, block_size=16
    )
    got = paged_attention_cpu(*batch.args(), **batch.hints())
    torch.testing.assert_close(got, reference.paged_attention(*batch.args()))
    assert calls == [2]  # the two decode rows, in one call


def test_the_build_is_cached_per_source_and_a_missing_compiler_falls_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(cpu_native.CACHE_ENV, str(tmp_path / "cache"))
    assert cpu_native.load("cpu_decode_attention") is not None
    built = list((tmp_path / "cache").glob("cpu_decode_attention-*.so"))
    assert len(built) == 1
    cpu_native._load.cache_clear()  # a fresh process: the cached library is loaded, not rebuilt
    mtime = built[0].stat().st_mtime_ns
    assert cpu_native.load("cpu_decode_attention") is not None
    assert built[0].stat().st_mtime_ns == mtime
    assert list((tmp_path / "cache").iterdir()) == built  # no temporary file left

    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv(cpu_native.CACHE_ENV, str(tmp_path / "other"))
    assert cpu_native.load("cpu_decode_attention") is None
    monkeypatch.setenv(cpu_native.NATIVE_ENV, "0")
    monkeypatch.delenv("CC")
    assert cpu_native.load("cpu_decode_attention") is None
    batch = _decode_batch(5, 8, 2, 64, 16, torch.float32)
    query, key_cache, value_cache, tables, _, lens, scale = batch.args()
    out = decode_attention_native(query, key_cache, value_cache, tables, lens, scale, 0, 0.0)
    assert out is None
    torch.testing.assert_close(
        paged_attention_cpu(*batch.args()), reference.paged_attention(*batch.args())
    )


def test_loading_the_kernel_leaves_subnormal_floats_alone() -> None:
    """A library linked with -ffast-math would set flush-to-zero for the whole process (GCC's
    crtfastmath.o): every float op after it, torch's and numpy's included, would change."""
    assert cpu_native.load("cpu_decode_attention") is not None
    tiny = np.float32(1e-45)  # the smallest subnormal
    assert tiny * np.float32(1.0) > 0
    assert float(torch.tensor([1e-45]) * 1.0) > 0


def test_a_peaked_softmax_flushes_subnormal_weights_and_every_thread_keeps_its_float_mode() -> None:
    """Scores hundreds apart make exp(s - max) subnormal (the kernel flushes those to zero
    while it runs: a change below 1e-38 against a weight of 1); the answer is still the
    reference's, and afterwards every torch thread computes with subnormals again."""
    batch = _decode_batch(3, 8, 2, 64, 16, torch.float32)
    batch.args()[0].mul_(400.0)
    want = reference.paged_attention(*batch.args())
    saved = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            torch.testing.assert_close(_native(batch), want, **TOLERANCES[torch.float32])
            tiny = torch.full((1 << 20,), 1e-40)  # split over every thread by torch
            assert bool(((tiny * 1.0) > 0).all())
    finally:
        torch.set_num_threads(saved)


def test_a_source_that_does_not_compile_falls_back_with_a_logged_reason(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "broken.c").write_text("int f(void) { return }\n")
    monkeypatch.setattr(cpu_native, "SOURCES", tmp_path / "src")
    monkeypatch.setenv(cpu_native.CACHE_ENV, str(tmp_path / "cache"))
    assert cpu_native.load("broken") is None
    assert not list((tmp_path / "cache").glob("*.so"))
