"""``--quantization bf16`` / ``fp16`` on the CPU: every decoder projection keeps its weight in
16 bits (the fp32 weight freed) and multiplies in fp32, the LM head and embeddings stay fp32;
a model's logits are those of the fp32 model whose projection weights were rounded the same
way (the only change), close to the unrounded model's; an fp16 weight past fp16's range and
anything but fp32 on the CPU are refused naming the flag."""

from __future__ import annotations

import pytest
import torch

from services.executor.model.errors import ModelLoadError
from services.executor.model.forward_batch import SeqChunk
from services.executor.model.layers.linear import Linear, plain_projections
from services.executor.model.prepack import PREPACK_ENV
from services.executor.model.quantization import HalfWeightLinear, quantize_model

from .conftest import CheckpointFactory, load_runner

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@pytest.mark.parametrize("method", ["bf16", "fp16"])
@pytest.mark.parametrize("name", ["llama", "qwen3_moe", "gemma3"])
def test_a_half_weight_model_is_the_fp32_model_with_its_projections_rounded(
    method: str, name: str, tiny_checkpoint: CheckpointFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(PREPACK_ENV, "0")  # the fp32 model keeps plain weights to round below
    base = load_runner(tiny_checkpoint(name), dtype="float32", num_kv_blocks=16)
    monkeypatch.delenv(PREPACK_ENV)
    half = load_runner(
        tiny_checkpoint(name), dtype="float32", num_kv_blocks=16, quantization=method
    )
    projections = plain_projections(base.model.layers)
    replaced = [m for layer in half.model.layers for m in layer.modules() if isinstance(m, Linear)]
    assert replaced and all(isinstance(m.quantized, HalfWeightLinear) for m in replaced)
    assert all(m.weight.numel() == 0 for m in replaced)
    assert half.model.lm_head.quantized is None and half.model.lm_head.weight.numel() > 0
    prompt = list(range(5, 60))
    chunk = [SeqChunk(prompt, 0, [1, 2, 3, 4], all_logits=True)]
    expected = base.execute(chunk)
    got = half.execute(chunk)
    with torch.no_grad():  # the same rounding done to the fp32 model's own weights
        for module in projections:
            module.weight.copy_(module.weight.to(DTYPES[method]).float())
    rounded = base.execute(chunk)
    torch.testing.assert_close(got, rounded, rtol=1e-4, atol=1e-4)
    spread = (expected.max() - expected.min()).item()
    assert (got - expected).abs().mean().item() < 0.01 * spread
    assert (got.argmax(-1) == expected.argmax(-1)).float().mean().item() >= 0.9


def test_an_fp16_weight_past_its_range_is_refused_naming_the_other_format(
    tiny_checkpoint: CheckpointFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(PREPACK_ENV, "0")
    runner = load_runner(tiny_checkpoint("llama"), dtype="float32", num_kv_blocks=16)
    first = plain_projections(runner.model.layers)[0]
    with torch.no_grad():
        first.weight[0, 0] = 1e5
    with pytest.raises(ModelLoadError, match="--quantization bf16"):
        quantize_model(runner.model, "fp16")
    assert first.quantized is None  # checked before any layer changed
    assert quantize_model(runner.model, "bf16") > 0  # bf16 has fp32's range


@pytest.mark.parametrize("method", ["bf16", "fp16"])
def test_half_weights_on_a_16_bit_model_are_refused_naming_the_flag(
    method: str, tiny_checkpoint: CheckpointFactory
) -> None:
    with pytest.raises(ModelLoadError, match=f"--quantization {method}"):
        load_runner(tiny_checkpoint("llama"), dtype="bfloat16", quantization=method)
