"""``--kv-cache-dtype fp8`` (e4m3, e5m2), ``int8`` and ``bfloat16`` on the CPU: K/V are stored
in fp8, scaled by each layer's ``k_scale`` / ``v_scale`` (an fp8 checkpoint's, computed at
start-up, else 1.0) and scaled back when read; int8 as records each with its own scale; bf16
rounded. The same memory holds four (fp8; int8 a little less) or two (bf16) times the blocks
of an fp32 cache; logits read back from the cache (a prefill in two chunks) stay close to
fp32's."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from services.executor.model.forward_batch import SeqChunk
from services.executor.model.kv_cache import KV_CACHE_DTYPES
from services.executor.model.runner_config import KV_CACHE_DTYPE_NAMES

from .conftest import CheckpointFactory, load_runner

PROMPT = list(range(5, 60))


def _two_chunks(runner) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """Every position's logits of PROMPT prefilled in two chunks (the second reads the
    first's K/V back from the cache)."""
    table = [1, 2, 3, 4]
    first = runner.execute([SeqChunk(PROMPT[:30], 0, table, all_logits=True)])
    second = runner.execute([SeqChunk(PROMPT[30:], 30, table, all_logits=True)])
    return torch.cat([first, second])


@pytest.mark.parametrize("name", ["llama", "gemma3", "qwen3_moe"])
def test_an_fp8_cache_keeps_the_logits_close_to_fp32(
    name: str, tiny_checkpoint: CheckpointFactory
) -> None:
    base = load_runner(tiny_checkpoint(name), dtype="float32", num_kv_blocks=16)
    expected = _two_chunks(base)
    spread = (expected.max() - expected.min()).item()
    cases = (
        ("bfloat16", 0.005, 0.95),
        ("fp8_e4m3", 0.02, 0.8),
        ("fp8_e5m2", 0.04, 0.5),
        ("int8", 0.01, 0.9),
    )
    for kv_dtype, tol, agree in cases:
        runner = load_runner(
            tiny_checkpoint(name), dtype="float32", num_kv_blocks=16, kv_cache_dtype=kv_dtype
        )
        assert runner.kv_cache.dtype == KV_CACHE_DTYPES[kv_dtype]
        got = _two_chunks(runner)
        assert (got - expected).abs().mean().item() < tol * spread, kv_dtype
        assert (got.argmax(-1) == expected.argmax(-1)).float().mean().item() >= agree


def test_the_same_memory_holds_four_times_the_blocks_of_fp32_in_fp8_and_bf16_twice(
    tiny_checkpoint: CheckpointFactory,
) -> None:
    sizes = {}
    for kv_dtype in ("auto", "bfloat16", "fp8", "int8"):
        runner = load_runner(
            tiny_checkpoint("llama"),
            dtype="float32",
            num_kv_blocks=None,
            kv_cache_memory=2**20,
            max_model_len=256,
            kv_cache_dtype=kv_dtype,
        )
        sizes[kv_dtype] = runner.num_blocks
    assert sizes["fp8"] == pytest.approx(4 * sizes["auto"], abs=4)
    assert sizes["bfloat16"] == pytest.approx(2 * sizes["auto"], abs=2)
    # int8 records: head_dim codes + a 4-byte scale per token and head (head_dim 16 here).
    assert sizes["int8"] == pytest.approx(4 * 16 / 20 * sizes["auto"], abs=4)


def test_an_fp8_checkpoints_kv_scales_scale_what_the_cache_stores(
    tiny_checkpoint: CheckpointFactory, tmp_path: Path
) -> None:
    """llm-compressor's ``self_attn.k_scale`` / ``v_scale``: K/V are stored divided by them
    (half the magnitude with 2.0) and the logits are the same model's."""
    scaled = tmp_path / "scaled"
    shutil.copytree(tiny_checkpoint("llama"), scaled)
    (file,) = scaled.glob("*.safetensors")
    weights = load_file(file)
    for i in range(2):
        for which in "kv":
            weights[f"model.layers.{i}.self_attn.{which}_scale"] = torch.tensor(2.0)
    save_file(weights, file, metadata={"format": "pt"})
    plain = load_runner(tiny_checkpoint("llama"), dtype="float32", kv_cache_dtype="fp8")
    halved = load_runner(scaled, dtype="float32", kv_cache_dtype="fp8")
    assert halved.model.layers[0].self_attn.k_scale == 2.0
    a, b = _two_chunks(plain), _two_chunks(halved)
    stored = [r.kv_cache[:, :, 1:5].float().abs().mean().item() for r in (plain, halved)]
    assert stored[1] == pytest.approx(stored[0] / 2, rel=0.1)
    spread = (a.max() - a.min()).item()
    assert (a - b).abs().mean().item() < 0.02 * spread
    unquantized = load_runner(scaled, dtype="float32")  # an fp32 cache ignores the scales
    assert unquantized.kv_cache.dtype == torch.float32


def test_the_cli_offers_every_cache_dtype_the_model_side_knows() -> None:
    assert tuple(KV_CACHE_DTYPES) == KV_CACHE_DTYPE_NAMES
