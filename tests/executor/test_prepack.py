"""fp32 projections packed at load for oneDNN on the CPU: each computes what its plain weight
did (up to fp32 rounding), its plain weight is freed, the embeddings and the LM head are
left alone, and packing is off for other dtypes and when the environment says so."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from services.executor.model.layers.linear import Linear
from services.executor.model.loader import load_model
from services.executor.model.prepack import PREPACK_ENV, PackedLinear, prepack_model


def test_packed_projections_compute_what_their_plain_weights_did(tiny_checkpoint: Any) -> None:
    model = load_model(tiny_checkpoint("llama"), dtype="float32")
    layers = [m for layer in model.layers for m in layer.modules() if isinstance(m, Linear)]
    gen = torch.Generator().manual_seed(0)
    inputs = [torch.randn(5, m.in_features, generator=gen) for m in layers]
    before = [m(x) for m, x in zip(layers, inputs, strict=True)]
    head = model.lm_head.weight.clone()
    assert prepack_model(model) == len(layers) == 4 * len(model.layers)
    for m, x, y in zip(layers, inputs, before, strict=True):
        assert isinstance(m.quantized, PackedLinear) and m.weight.numel() == 0
        torch.testing.assert_close(m(x), y, rtol=1e-5, atol=1e-5)
        assert m(x[:0]).shape == (0, m.out_features)
    assert torch.equal(model.lm_head.weight, head)


@pytest.mark.parametrize(("dtype", "env"), [("bfloat16", None), ("float32", "0")])
def test_packing_is_off_for_other_dtypes_and_by_the_environment(
    tiny_checkpoint: Any, monkeypatch: pytest.MonkeyPatch, dtype: str, env: str | None
) -> None:
    if env is not None:
        monkeypatch.setenv(PREPACK_ENV, env)
    model = load_model(tiny_checkpoint("llama"), dtype=dtype)
    assert prepack_model(model) == 0
    assert all(layer.self_attn.o_proj.weight.numel() for layer in model.layers)
