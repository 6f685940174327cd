"""``--quantization int8`` on the CPU: every decoder projection is served by a packed int8
weight (per-row scales, the fp32 weight freed) with per-row dynamic activations, the LM head
and embeddings stay fp32; one layer's outputs are within 1 % of fp32 (relative), a model's
logits stay close and mostly agree on the top token; anything but fp32 on the CPU is refused
naming the flag."""

from __future__ import annotations

import pytest
import torch

from services.executor.model.errors import ModelLoadError
from services.executor.model.forward_batch import SeqChunk
from services.executor.model.layers.linear import Linear
from services.executor.model.quantization import Int8Linear

from .conftest import CheckpointFactory, load_runner


def test_an_int8_layer_is_within_a_percent_of_fp32_and_keeps_its_bias() -> None:
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(96, 64, generator=gen) * 0.1
    bias = torch.randn(96, generator=gen)
    x = torch.randn(7, 64, generator=gen)
    x[3] *= 40  # one row far larger than the others: per-row scales keep the rest precise
    expected = x @ weight.T + bias
    got = Int8Linear(weight, bias)(x)
    for row in range(7):
        err = (got[row] - expected[row]).norm() / expected[row].norm()
        assert err < 0.01, row
    assert Int8Linear(weight, None)(x[:0]).shape == (0, 96)


@pytest.mark.parametrize("name", ["llama", "phi3", "qwen3_moe", "gemma3"])
def test_a_quantized_model_keeps_its_logits_close_and_its_top_tokens(
    name: str, tiny_checkpoint: CheckpointFactory
) -> None:
    base = load_runner(tiny_checkpoint(name), dtype="float32", num_kv_blocks=16)
    quant = load_runner(
        tiny_checkpoint(name), dtype="float32", num_kv_blocks=16, quantization="int8"
    )
    linears = [m for layer in quant.model.layers for m in layer.modules() if isinstance(m, Linear)]
    assert linears and all(m.quantized is not None and m.weight.numel() == 0 for m in linears)
    assert quant.model.lm_head.quantized is None and quant.model.lm_head.weight.numel() > 0
    prompt = list(range(5, 60))
    chunk = [SeqChunk(prompt, 0, [1, 2, 3, 4], all_logits=True)]
    expected, got = base.execute(chunk), quant.execute(chunk)
    spread = (expected.max() - expected.min()).item()
    assert (got - expected).abs().mean().item() < 0.03 * spread
    assert (got.argmax(-1) == expected.argmax(-1)).float().mean().item() >= 0.75


@pytest.mark.parametrize("name", ["llama", "phi3"])
def test_int8_shards_at_tensor_parallel_two_keep_the_logits_of_one_rank(
    name: str, tiny_checkpoint: CheckpointFactory
) -> None:
    """TP = 2: each rank quantizes its shard (a column-parallel shard's rows keep one rank's
    scales; a row-parallel shard's rows are scaled over their half), as close to fp32 as one
    rank's int8 is."""
    base = load_runner(tiny_checkpoint(name), dtype="float32", num_kv_blocks=16)
    one = load_runner(tiny_checkpoint(name), dtype="float32", num_kv_blocks=16, quantization="int8")
    two = load_runner(
        tiny_checkpoint(name),
        dtype="float32",
        num_kv_blocks=16,
        quantization="int8",
        tensor_parallel_size=2,
    )
    try:
        prompt = list(range(5, 60))
        chunk = [SeqChunk(prompt, 0, [1, 2, 3, 4], all_logits=True)]
        expected, single, sharded = base.execute(chunk), one.execute(chunk), two.execute(chunk)
    finally:
        two.close()
    spread = (expected.max() - expected.min()).item()
    single_err = (single - expected).abs().mean().item()
    sharded_err = (sharded - expected).abs().mean().item()
    assert sharded_err < 0.03 * spread and sharded_err < 2 * single_err + 1e-3 * spread
    agree = (sharded.argmax(-1) == expected.argmax(-1)).float().mean().item()
    assert agree >= 0.75
    assert not torch.equal(sharded, expected)  # (quantized: not the fp32 logits)


def test_int8_on_anything_but_fp32_on_the_cpu_is_refused_naming_the_flag(
    tiny_checkpoint: CheckpointFactory,
) -> None:
    with pytest.raises(ModelLoadError, match="--quantization int8"):
        load_runner(tiny_checkpoint("llama"), dtype="bfloat16", quantization="int8")
