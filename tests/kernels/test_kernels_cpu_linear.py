"""The CPU linear layers (``pagedserve/kernels/cpu_linear.py``, what ``ops.linear`` serves on the
CPU): oneDNN for fp32 within fp32 rounding of ``torch.nn.functional.linear``, the other dtypes
and ``PAGEDSERVE_CPU_LINEAR=torch`` exactly ``torch.nn.functional.linear``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from pagedserve.kernels import ops
from pagedserve.kernels.cpu_linear import CPU_LINEAR_ENV, cpu_linear_impl
from services.executor.model.config import ModelConfig
from services.executor.model.layers.linear import Linear
from services.executor.model.models.llama import DecoderLM


def _operands(dtype: torch.dtype, rows: int = 37) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=g).to(dtype)
    w = (torch.randn(80, 96, generator=g) * 0.1).to(dtype)
    b = torch.randn(80, generator=g).to(dtype)
    return x, w, b


class _Ops(TorchDispatchMode):
    """Records the aten / mkldnn ops run inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch without oneDNN")
@pytest.mark.parametrize("rows", [0, 1, 37, 300])
@pytest.mark.parametrize("bias", ["bias", "no-bias", "strided-bias"])
def test_fp32_linear_goes_through_onednn_within_fp32_rounding(rows: int, bias: str) -> None:
    x, w, b = _operands(torch.float32, rows)
    if bias == "strided-bias":  # a view oneDNN would misread unless packed
        b = torch.randn(160, generator=torch.Generator().manual_seed(1))[::2]
    assert cpu_linear_impl() == "onednn"
    with _Ops() as seen:
        got = ops.linear(x, w, None if bias == "no-bias" else b)
    assert any("_linear_pointwise" in name for name in seen.names)
    want = (x.double() @ w.double().T + (0 if bias == "no-bias" else b.double())).float()
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


def test_every_projection_of_the_model_is_a_linear_layer_but_the_moe_router() -> None:
    hf = {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 100,
        "max_position_embeddings": 64,
        "rms_norm_eps": 1e-6,
    }
    model = DecoderLM.empty(ModelConfig.from_hf_config(hf), torch.float32, "meta")
    names = {n for n, m in model.named_modules() if type(m) is nn.Linear}
    assert names <= {n for n, _ in model.named_modules() if n.endswith("mlp.gate")}
    assert isinstance(model.lm_head, Linear)
    assert all(isinstance(layer.self_attn.qkv_proj, Linear) for layer in model.layers)
