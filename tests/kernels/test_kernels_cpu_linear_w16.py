"""The 16-bit-weight linear kernel (``cpu_linear_w16``): its packing keeps exactly the values
of the weight rounded to bf16 or fp16, and its product equals torch's fp32 ``F.linear`` with
those values, on the AVX-512 path and on the portable one a CPU without AVX-512 runs, at
decode sizes (one thread, one row chunk) and prefill sizes (row and input chunks, threads)."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from pagedserve.kernels import cpu_linear_w16, cpu_native

pytestmark = pytest.mark.skipif(
    cpu_native.load("cpu_linear_w16") is None,
    reason="no C compiler here: the native CPU kernels cannot be built",
)

FORMATS = ["bf16", "fp16"]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("out_features", [1, 31, 32, 100])
def test_packing_keeps_the_rounded_weight_exactly(fmt: str, out_features: int) -> None:
    weight = torch.randn(out_features, 70, generator=_gen(out_features))
    packed = cpu_linear_w16.pack(weight, fmt)
    assert packed.shape == (-(-out_features // 32), 70, 32)
    rounded = weight.to(cpu_linear_w16.WEIGHT_DTYPES[fmt]).float()
    assert torch.equal(cpu_linear_w16.unpack(packed, out_features), rounded)


@pytest.mark.parametrize("portable", [False, True], ids=["avx512-or-native", "portable"])
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(
    ("rows", "out_features", "in_features"),
    [
        (1, 96, 64),  # one decode row
        (5, 31, 64),  # fewer columns than a block
        (13, 100, 300),  # a full row tile and one more row; inputs past one chunk of 256
        (64, 64, 512),  # a decode step's batch
        (200, 100, 300),  # past a row chunk of 192, shared over threads
    ],
)
@pytest.mark.parametrize("with_bias", [True, False])
def test_the_product_equals_fp32_linear_with_the_rounded_weight(
    portable: bool, fmt: str, rows: int, out_features: int, in_features: int, with_bias: bool
) -> None:
    g = _gen(rows * out_features)
    weight = torch.randn(out_features, in_features, generator=g) / in_features**0.5
    bias = torch.randn(out_features, generator=g) if with_bias else None
    x = torch.randn(rows, in_features, generator=g)
    packed = cpu_linear_w16.pack(weight, fmt)
    got = cpu_linear_w16.linear(x, packed, bias, out_features, portable=portable)
    assert got is not None
    want = F.linear(x, cpu_linear_w16.unpack(packed, out_features), bias)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("portable", [False, True], ids=["avx512-or-native", "portable"])
def test_fp16_subnormals_zeros_and_the_largest_values_widen_exactly(portable: bool) -> None:
    """fp16's edge values (the portable path widens them bit by bit): a product with unit
    rows reads each weight back."""
    values = [0.0, -0.0, 6e-8, -3e-6, 6.1e-5, 1.0, -2.5, 65504.0, -65504.0, 1e-3]
    weight = torch.tensor(values * 4, dtype=torch.float32).reshape(40, 1).repeat(1, 16)
    packed = cpu_linear_w16.pack(weight, "fp16")
    x = torch.zeros(16, 16)
    x[:, 0] = 1.0  # each row reads column 0 of every output
    got = cpu_linear_w16.linear(x, packed, None, 40, portable=portable)
    assert got is not None
    want = weight.to(torch.float16).float()[:, 0].expand(16, 40)
    assert torch.equal(got, want)


def test_a_strided_view_and_a_single_row_of_any_stride_read_their_own_features() -> None:
    g = _gen(7)
    weight = torch.randn(64, 128, generator=g)
    packed = cpu_linear_w16.pack(weight, "bf16")
    wide = torch.randn(9, 300, generator=g)
    x = wide[:, 100:228]  # rows 300 apart
    want = F.linear(x, cpu_linear_w16.unpack(packed, 64))
    got = cpu_linear_w16.linear(x, packed, None, 64)
    assert got is not None
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    one = torch.randn(128, 1, generator=g).T  # [1, 128] whose row stride is 1
    got_one = cpu_linear_w16.linear(one, packed, None, 64)
    assert got_one is not None
    torch.testing.assert_close(got_one, F.linear(one, cpu_linear_w16.unpack(packed, 64)))
    empty = cpu_linear_w16.linear(x[:0], packed, None, 64)
    assert empty is not None and empty.shape == (0, 64)


def test_mismatched_sizes_and_formats_are_refused_naming_them() -> None:
    packed = cpu_linear_w16.pack(torch.randn(40, 16), "bf16")
    with pytest.raises(ValueError, match=r"\[3, 17\]"):
        cpu_linear_w16.linear(torch.randn(3, 17), packed, None, 40)
    with pytest.raises(ValueError, match="fp32"):
        cpu_linear_w16.linear(torch.randn(3, 16, dtype=torch.float64), packed, None, 40)
    with pytest.raises(ValueError, match="weight format"):
        cpu_linear_w16.pack(torch.randn(4, 4), "int4")
