"""``--calculate-kv-scales``: an fp8 cache's per-layer scales from a calibration prefill at
start-up: ``max|K| / 200`` and ``max|V| / 100`` of the K/V transformers computes for the same
tokens (its cache holds them after RoPE and QK-norm, as ours does); they keep the logits of a
model whose K/V overflow fp8 at scale 1.0 close to fp32's."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import PreTrainedModel

from services.executor.model.kv_calibration import CALIBRATION_TOKENS, calibration_tokens
from services.executor.service.config import ExecutorConfig

from .conftest import CheckpointFactory, load_runner
from .test_fp8_kv_cache import _two_chunks


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_the_scales_are_the_largest_k_and_v_transformers_computes_over_the_calibration_text(
    name: str,
    tiny_checkpoint: CheckpointFactory,
    hf_model: Callable[[str], PreTrainedModel],
) -> None:
    runner = load_runner(
        tiny_checkpoint(name), dtype="float32", kv_cache_dtype="fp8", calculate_kv_scales=True
    )
    mc = runner.model.config
    tokens = calibration_tokens(
        tiny_checkpoint(name), mc.vocab_size, min(CALIBRATION_TOKENS, mc.max_model_len)
    )
    with torch.inference_mode():
        cache = hf_model(name)(torch.tensor([tokens]), use_cache=True).past_key_values
    for i, layer in enumerate(runner.model.layers):
        keys, values = cache.layers[i].keys, cache.layers[i].values
        assert layer.self_attn.k_scale == pytest.approx(keys.abs().max().item() / 200, rel=1e-5)
        assert layer.self_attn.v_scale == pytest.approx(values.abs().max().item() / 100, rel=1e-5)
    assert len(set(tokens)) > 20  # the tokenizer's text, not one repeated id


def test_calculated_scales_keep_a_model_whose_kv_overflow_fp8_close_to_fp32(
    tiny_checkpoint: CheckpointFactory, tmp_path: Path
) -> None:
    """K/V a thousand times larger than e4m3's largest value (448): with scales of 1.0 they
    saturate and the logits go wrong; calculated scales keep them close, as checkpoint scales
    would."""
    loud = tmp_path / "loud"
    shutil.copytree(tiny_checkpoint("llama"), loud)
    (file,) = loud.glob("*.safetensors")
    weights = load_file(file)
    for i in range(2):
        # V x 1000 and O / 1000: the same model, with K/V far past fp8's range.
        weights[f"model.layers.{i}.self_attn.v_proj.weight"] *= 1000.0
        weights[f"model.layers.{i}.self_attn.o_proj.weight"] /= 1000.0
    save_file(weights, file, metadata={"format": "pt"})
    expected = _two_chunks(load_runner(loud, dtype="float32"))
    spread = (expected.max() - expected.min()).item()
    unscaled = _two_chunks(load_runner(loud, dtype="float32", kv_cache_dtype="fp8"))
    calculated = load_runner(loud, dtype="float32", kv_cache_dtype="fp8", calculate_kv_scales=True)
    assert calculated.model.layers[0].self_attn.v_scale > 1.0
    got = _two_chunks(calculated)
    assert (got - expected).abs().mean().item() < 0.02 * spread
    assert (unscaled - expected).abs().mean().item() > 0.05 * spread


def test_calculated_scales_are_the_same_at_every_start(tiny_checkpoint: CheckpointFactory) -> None:
    scales = [
        [
            (layer.self_attn.k_scale, layer.self_attn.v_scale)
            for layer in load_runner(
                tiny_checkpoint("gemma3"),
                dtype="float32",
                kv_cache_dtype="fp8_e5m2",
                calculate_kv_scales=True,
            ).model.layers
        ]
        for _ in range(2)
    ]
    assert scales[0] == scales[1] and scales[0][0] != (1.0, 1.0)


def test_calculating_scales_for_a_cache_that_has_none_is_refused_naming_the_flags() -> None:
    with pytest.raises(ValueError, match=r"--calculate-kv-scales .* --kv-cache-dtype fp8"):
        ExecutorConfig(model="m", kv_cache_dtype="int8", calculate_kv_scales=True)
