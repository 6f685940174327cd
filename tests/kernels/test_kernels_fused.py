"""The fused elementwise kernels (residual add + RMSNorm with a ``w`` or Gemma's ``1 + w``
gain, rotary embedding over whole or partial heads, SiLU- and tanh-GELU-and-mul) against
their torch references: under the Triton interpreter in fp32 and fp16 here, in bf16 on a GPU
(``gpu``)."""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels import ops, reference
from pagedserve.kernels.fused_add_rms_norm import fused_add_rms_norm_triton
from pagedserve.kernels.rotary_embedding import rotary_embedding_triton
from pagedserve.kernels.silu_and_mul import gelu_tanh_and_mul_triton, silu_and_mul_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CPU_DTYPES = [torch.float32, torch.float16]
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def _randn(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(dtype).to(DEVICE)


def _close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    tol = TOL[dtype]
    torch.testing.assert_close(actual.float(), expected.float(), rtol=tol, atol=tol)


def _check_add_rms_norm(
    dtype: torch.dtype, hidden: int, with_residual: bool, unit_offset: bool = False
) -> None:
    x = _randn(7, hidden, dtype=dtype, seed=0)
    weight = _randn(hidden, dtype=dtype, seed=1)
    residual = _randn(7, hidden, dtype=dtype, seed=2) if with_residual else None
    ref_residual = residual.clone() if residual is not None else None
    expected = reference.fused_add_rms_norm(x, ref_residual, weight, 1e-6, unit_offset)
    out = fused_add_rms_norm_triton(x, residual, weight, 1e-6, unit_offset)
    _close(out, expected, dtype)
    if residual is not None:
        assert ref_residual is not None
        assert torch.equal(residual, ref_residual)  # the sum, rounded once: bit-exact


@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
@pytest.mark.parametrize("hidden", [64, 96, 1000])
@pytest.mark.parametrize("with_residual", [True, False], ids=["residual", "plain"])
def test_add_rms_norm_matches_reference_and_updates_the_residual(dtype, hidden, with_residual):
    _check_add_rms_norm(dtype, hidden, with_residual)


@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
@pytest.mark.parametrize("with_residual", [True, False], ids=["residual", "plain"])
def test_gemma_unit_offset_norm_matches_reference(dtype, with_residual):
    _check_add_rms_norm(dtype, 96, with_residual, unit_offset=True)


def test_gemma_unit_offset_norm_scales_by_one_plus_the_weight_in_fp32() -> None:
    """Gemma's gain is ``1 + w`` applied before the one rounding: a zero weight is a plain
    RMSNorm, and the result differs from Llama's ``w * norm`` on the same weight."""
    x = _randn(4, 32, dtype=torch.float32, seed=11)
    plain = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    zero = torch.zeros(32, device=DEVICE)
    torch.testing.assert_close(reference.fused_add_rms_norm(x, None, zero, 1e-6, True), plain)
    w = _randn(32, dtype=torch.float32, seed=12)
    torch.testing.assert_close(
        reference.fused_add_rms_norm(x, None, w, 1e-6, True), plain * (1 + w)
    )


def _check_rotary(dtype: torch.dtype, num_q: int, num_kv: int, head_dim: int) -> None:
    num_tokens, max_len = 9, 64
    qkv = _randn(num_tokens, (num_q + 2 * num_kv) * head_dim, dtype=dtype, seed=3)
    q = qkv[:, : num_q * head_dim].view(num_tokens, num_q, head_dim)  # strided views
    k = qkv[:, num_q * head_dim : (num_q + num_kv) * head_dim].view(num_tokens, num_kv, head_dim)
    v_before = qkv[:, (num_q + num_kv) * head_dim :].clone()
    angles = torch.rand(max_len, head_dim // 2, generator=torch.Generator().manual_seed(4)) * 6
    cos, sin = angles.cos().to(dtype).to(DEVICE), angles.sin().to(dtype).to(DEVICE)
    positions = torch.tensor([0, 5, 63, 1, 1, 17, 40, 2, 33], device=DEVICE)
    q_ref, k_ref = q.clone(), k.clone()
    reference.rotary_embedding(positions, q_ref, k_ref, cos, sin)
    rotary_embedding_triton(positions, q, k, cos, sin)
    _close(q, q_ref, dtype)
    _close(k, k_ref, dtype)
    assert torch.equal(qkv[:, (num_q + num_kv) * head_dim :], v_before)  # v untouched


@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
@pytest.mark.parametrize(
    ("num_q", "num_kv", "head_dim"), [(4, 2, 64), (6, 3, 32), (8, 1, 128), (5, 5, 80)]
)
def test_rotary_rotates_strided_q_and_k_in_place_like_the_reference(dtype, num_q, num_kv, head_dim):
    _check_rotary(dtype, num_q, num_kv, head_dim)


def _check_silu_and_mul(dtype: torch.dtype, inter: int) -> None:
    x = _randn(5, 2 * inter, dtype=dtype, seed=5) * 4
    _close(silu_and_mul_triton(x), reference.silu_and_mul(x), dtype)


def _check_gelu_tanh_and_mul(dtype: torch.dtype, inter: int) -> None:
    x = _randn(5, 2 * inter, dtype=dtype, seed=13) * 4
    x[0, :4] = torch.tensor([-30.0, 30.0, 0.0, -3.0], dtype=dtype)  # tanh saturates: no NaN
    _close(gelu_tanh_and_mul_triton(x), reference.gelu_tanh_and_mul(x), dtype)


@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
@pytest.mark.parametrize("inter", [64, 176, 2100])
def test_silu_and_mul_matches_reference(dtype, inter):
    _check_silu_and_mul(dtype, inter)


@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
@pytest.mark.parametrize("inter", [64, 176])
def test_gelu_tanh_and_mul_matches_transformers_gelu_pytorch_tanh(dtype, inter):
    _check_gelu_tanh_and_mul(dtype, inter)


def test_rotary_over_the_first_part_of_each_head_leaves_the_rest_untouched() -> None:
    """Partial rotary (Phi-4-mini): the op gets views of the first 3/4 of each head."""
    q = _randn(6, 4, 16, dtype=torch.float32, seed=14)
    k = _randn(6, 2, 16, dtype=torch.float32, seed=15)
    q_ref, k_ref = q.clone(), k.clone()
    angles = torch.rand(32, 6, generator=torch.Generator().manual_seed(16)) * 6
    cos, sin = angles.cos().to(DEVICE), angles.sin().to(DEVICE)
    positions = torch.tensor([0, 3, 31, 7, 7, 12], device=DEVICE)
    reference.rotary_embedding(positions, q_ref[..., :12], k_ref[..., :12], cos, sin)
    rotary_embedding_triton(positions, q[..., :12], k[..., :12], cos, sin)
    _close(q, q_ref, torch.float32)
    _close(k, k_ref, torch.float32)
    assert torch.equal(q[..., 12:], _randn(6, 4, 16, dtype=torch.float32, seed=14)[..., 12:])


def test_ops_dispatch_reaches_the_fused_kernels(force_triton, monkeypatch) -> None:
    calls: list[str] = []
    import pagedserve.kernels.fused_add_rms_norm as n
    import pagedserve.kernels.rotary_embedding as r
    import pagedserve.kernels.silu_and_mul as s

    for mod, name in (
        (n, "fused_add_rms_norm_triton"),
        (r, "rotary_embedding_triton"),
        (s, "silu_and_mul_triton"),
    ):
        real = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, _r=real, _n=name: calls.append(_n) or _r(*a))
    x = _randn(3, 64, dtype=torch.float32, seed=6)
    ops.fused_add_rms_norm(x, None, torch.ones(64, device=DEVICE), 1e-6)
    q, k = (
        _randn(3, 2, 8, dtype=torch.float32, seed=7),
        _randn(3, 1, 8, dtype=torch.float32, seed=8),
    )
    table = torch.ones(4, 4, device=DEVICE)
    ops.rotary_embedding(torch.zeros(3, dtype=torch.int64, device=DEVICE), q, k, table, table)
    ops.silu_and_mul(x)
    assert calls == ["fused_add_rms_norm_triton", "rotary_embedding_triton", "silu_and_mul_triton"]


def test_fused_kernels_reject_bad_shapes_with_clear_errors() -> None:
    x = _randn(3, 64, dtype=torch.float32, seed=9)
    with pytest.raises(ValueError, match="weight"):
        fused_add_rms_norm_triton(x, None, torch.ones(32, device=DEVICE), 1e-6)
    with pytest.raises(ValueError, match=r"\[T, 2I\]"):
        silu_and_mul_triton(x[:, :63])
    q = _randn(3, 2, 8, dtype=torch.float32, seed=10)
    with pytest.raises(ValueError, match="tables"):
        rotary_embedding_triton(torch.zeros(3, dtype=torch.int64), q, q, x[:4, :3], x[:4, :3])


@pytest.mark.gpu
def test_fused_kernels_match_references_in_bf16_on_cuda() -> None:
    for hidden in (64, 2048, 5000):
        for with_residual in (True, False):
            _check_add_rms_norm(torch.bfloat16, hidden, with_residual)
    for num_q, num_kv, head_dim in ((32, 8, 64), (28, 4, 128), (5, 5, 80)):
        _check_rotary(torch.bfloat16, num_q, num_kv, head_dim)
    for inter in (176, 8192, 14336):
        _check_silu_and_mul(torch.bfloat16, inter)
        _check_gelu_tanh_and_mul(torch.bfloat16, inter)
    for with_residual in (True, False):
        _check_add_rms_norm(torch.bfloat16, 1152, with_residual, unit_offset=True)
