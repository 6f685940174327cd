"""The CPU linear layers (``kernels/cpu_linear.py``, what ``ops.linear`` serves on the CPU):
oneDNN for fp32 within fp32 rounding of ``torch.nn.functional.linear``, the other dtypes
and ``PAGEDSERVE_CPU_LINEAR=torch`` exactly ``torch.nn.functional.linear``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import ops
from kernels.cpu_linear import CPU_LINEAR_ENV, cpu_linear_impl
from services.executor.model.layers.linear import Linear


def _operands(dtype: torch.dtype, rows: int = 37) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=g).to(dtype)
    w = (torch.randn(80, 96, generator=g) * 0.1).to(dtype)
    b = torch.randn(80, generator=g).to(dtype)
    return x, w, b


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch without oneDNN")
@pytest.mark.parametrize("rows", [0, 1, 37, 300])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
def test_fp32_linear_goes_through_onednn_within_fp32_rounding(rows: int, bias: bool) -> None:
    x, w, b = _operands(torch.float32, rows)
    assert cpu_linear_impl() == "onednn"
    got = ops.linear(x, w, b if bias else None)
    want = (x.double() @ w.double().T + (b.double() if bias else 0)).float()
    assert got.shape == (rows, 80) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_linear_is_torchs_own(dtype: torch.dtype) -> None:
    x, w, b = _operands(dtype)
    assert torch.equal(ops.linear(x, w, b), F.linear(x, w, b))


def test_the_torch_choice_is_exactly_torchs_linear(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CPU_LINEAR_ENV, "torch")
    x, w, b = _operands(torch.float32)
    assert torch.equal(ops.linear(x, w, b), F.linear(x, w, b))


def test_an_unknown_cpu_linear_is_refused_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(CPU_LINEAR_ENV, "blas")
    with pytest.raises(ValueError, match=CPU_LINEAR_ENV):
        cpu_linear_impl()


def test_the_linear_layer_keeps_nn_linear_parameters_and_computes_through_ops() -> None:
    layer = Linear(96, 80, bias=True)
    assert [n for n, _ in layer.named_parameters()] == ["weight", "bias"]
    x = torch.randn(5, 96)
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias))
