"""The native CPU passes for a decoder layer's small steps (``cpu_layer_ops``) against the
references they stand in for, on the layouts the model hands them (views of a fused
projection's output), at decode sizes (one thread) and prefill sizes (every thread)."""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels import cpu_layer_ops, cpu_native, ops, reference

pytestmark = pytest.mark.skipif(
    cpu_native.load("cpu_layer_ops") is None,
    reason="no C compiler here: the native CPU kernels cannot be built",
)

ROWS = [1, 7, 300]  # 300 rows x 512: past the size where the rows are shared over threads


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("with_residual", [True, False])
@pytest.mark.parametrize("unit_offset", [False, True])
def test_add_rms_norm_equals_the_reference_and_updates_the_residual(
    rows: int, with_residual: bool, unit_offset: bool
) -> None:
    g = _gen(rows)
    wide = torch.randn(rows, 640, generator=g) * 3
    x = wide[:, 64:576]  # a row stride wider than the row
    residual = torch.randn(rows, 512, generator=g) if with_residual else None
    weight = torch.randn(512, generator=g)
    want_residual = None if residual is None else residual.clone()
    want = reference.fused_add_rms_norm(x, want_residual, weight, 1e-6, unit_offset)
    got = cpu_layer_ops.add_rms_norm(x, residual, weight, 1e-6, unit_offset)
    assert got is not None
    torch.testing.assert_close(got, want)
    if residual is not None:
        torch.testing.assert_close(residual, want_residual, rtol=0, atol=0)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("rotary_dim", [64, 32], ids=["full", "partial"])
def test_rotary_rotates_views_of_the_fused_projection_as_the_reference(
    rows: int, rotary_dim: int
) -> None:
    """q/k as the attention layer has them: [T, H, D] views of the qkv output, a token's
    row spanning q, k and v; with a partial rotary dim, each head's first features only."""
    g = _gen(rows)
    heads, kv_heads, dim = 8, 2, 64
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim, generator=g)
    want_qkv = qkv.clone()
    positions = torch.randint(0, 500, (rows,), generator=g)
    cos, sin = torch.randn(500, rotary_dim // 2, generator=g), torch.randn(500, rotary_dim // 2)

    def views(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q, k, _ = t.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
        q, k = q.view(rows, heads, dim), k.view(rows, kv_heads, dim)
        return q[..., :rotary_dim], k[..., :rotary_dim]

    reference.rotary_embedding(positions, *views(want_qkv), cos, sin)
    assert cpu_layer_ops.rotary(positions, *views(qkv), cos, sin)
    torch.testing.assert_close(qkv, want_qkv)


def test_a_position_past_the_rotary_tables_is_refused_and_nothing_rotated() -> None:
    q, k = torch.randn(3, 4, 16), torch.randn(3, 2, 16)
    before = q.clone(), k.clone()
    cos = sin = torch.randn(10, 8)
    with pytest.raises(IndexError, match="1 positions outside the rotary tables"):
        cpu_layer_ops.rotary(torch.tensor([0, 10, 3]), q, k, cos, sin)
    assert torch.equal(q, before[0]) and torch.equal(k, before[1])


@pytest.mark.parametrize("rows", ROWS)
def test_silu_and_mul_equals_the_reference(rows: int) -> None:
    g = _gen(rows)
    x = torch.randn(rows, 2 * 1024, generator=g) * 4
    torch.testing.assert_close(cpu_layer_ops.silu_and_mul(x), reference.silu_and_mul(x))


def test_silu_and_mul_at_the_ends_of_the_range() -> None:
    """Gates where exp overflows or underflows: silu is 0 (to 1e-33) far below zero and the
    gate itself far above."""
    gate = torch.tensor([[-1e30, -1e4, -100.0, -88.5, -80.5, -79.0, -20.0, 0.0, 20.0, 1e4, 1e30]])
    x = torch.cat([gate, torch.full_like(gate, 2.0)], dim=-1)
    got = cpu_layer_ops.silu_and_mul(x)
    want = reference.silu_and_mul(x)
    assert got is not None and bool(torch.isfinite(got).all())
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-30)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_write_kv_equals_the_reference_and_skips_padding(dtype: torch.dtype) -> None:
    g = _gen(3)
    rows, kv_heads, dim, blocks, block_size = 6, 2, 16, 9, 4
    kv = torch.randn(rows, 2 * kv_heads * dim, generator=g).to(dtype)
    key, value = (t.view(rows, kv_heads, dim) for t in kv.split(kv_heads * dim, dim=-1))
    caches = [torch.randn(blocks, block_size, kv_heads, dim, generator=g).to(dtype) for _ in "kv"]
    want = [c.clone() for c in caches]
    slots = torch.tensor([5, -1, 0, 35, 12, -1])
    reference.reshape_and_cache(key, value, *want, slots)
    assert cpu_layer_ops.write_kv(key, value, *caches, slots)
    assert torch.equal(caches[0], want[0]) and torch.equal(caches[1], want[1])


def test_a_slot_past_the_cache_is_refused_and_nothing_written() -> None:
    key = value = torch.randn(2, 2, 8)
    caches = [torch.zeros(3, 4, 2, 8) for _ in "kv"]
    with pytest.raises(IndexError, match="1 slots outside the cache of 12 slots"):
        cpu_layer_ops.write_kv(key, value, *caches, torch.tensor([0, 12]))
    assert not caches[0].any() and not caches[1].any()


def test_what_the_passes_do_not_cover_is_declined() -> None:
    x16 = torch.randn(4, 32).to(torch.bfloat16)
    weight16 = torch.ones(32, dtype=torch.bfloat16)
    assert cpu_layer_ops.add_rms_norm(x16, None, weight16, 1e-6, False) is None
    assert cpu_layer_ops.silu_and_mul(x16) is None
    q16 = torch.randn(2, 4, 16).to(torch.bfloat16)
    assert not cpu_layer_ops.rotary(torch.tensor([0, 1]), q16, q16, *torch.randn(2, 10, 8))
    fp8_cache = torch.zeros(2, 4, 4, 16, dtype=torch.float8_e4m3fn)
    q = torch.randn(2, 4, 16)
    assert not cpu_layer_ops.write_kv(q, q, fp8_cache, fp8_cache, torch.tensor([0, 1]))


def test_ops_take_the_native_passes_for_fp32_and_the_reference_with_native_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    x = torch.randn(5, 64)
    native = ops.silu_and_mul(x), ops.fused_add_rms_norm(x, None, torch.ones(64), 1e-6)

    def refused(*args: object, **kwargs: object) -> None:
        raise AssertionError("the reference ran")

    with monkeypatch.context() as m:
        m.setattr(reference, "silu_and_mul", refused)
        m.setattr(reference, "fused_add_rms_norm", refused)
        ops.silu_and_mul(x), ops.fused_add_rms_norm(x, None, torch.ones(64), 1e-6)
    monkeypatch.setenv(cpu_native.NATIVE_ENV, "0")
    assert cpu_layer_ops.silu_and_mul(x) is None
    torch.testing.assert_close(ops.silu_and_mul(x), native[0])
    torch.testing.assert_close(ops.fused_add_rms_norm(x, None, torch.ones(64), 1e-6), native[1])
