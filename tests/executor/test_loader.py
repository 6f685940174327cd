"""Loading checkpoint directories: layouts, dtypes, devices, and clear errors when broken."""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedserve.tools.tiny_model import write_tiny_model
from services.executor.model.errors import ModelLoadError, UnsupportedModelError
from services.executor.model.forward_batch import SeqChunk
from services.executor.model.loader import load_model, load_tokenizer, weight_files
from services.executor.model.runner import ModelRunner

from .conftest import CHECKPOINTS, CheckpointFactory, load_runner

PROMPT = [1, 40, 41, 300, 7, 99, 250, 13, 14, 15, 600, 2, 3, 5, 8, 13, 21, 34]


def _logits(runner: ModelRunner) -> torch.Tensor:
    return runner.execute([SeqChunk(PROMPT, 0, [1, 2], need_logits=True)])[0]


@pytest.fixture
def llama_copy(tiny_checkpoint: CheckpointFactory, tmp_path: Path) -> Path:
    """A private copy of the tiny llama checkpoint, free to break."""
    return Path(shutil.copytree(tiny_checkpoint("llama"), tmp_path / "llama"))


def _edit_config(model_dir: Path, **changes: Any) -> None:
    path = model_dir / "config.json"
    config = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    path.write_text(json.dumps(config))


def test_sharded_checkpoint_loads_and_gives_identical_logits(
    tiny_checkpoint: CheckpointFactory, tmp_path: Path, make_runner: Callable[..., ModelRunner]
) -> None:
    sharded = write_tiny_model(tmp_path / "sharded", **CHECKPOINTS["llama"], max_shard_size="100KB")
    files = weight_files(sharded)
    assert len(files) > 2 and (sharded / "model.safetensors.index.json").is_file()
    assert not (sharded / "model.safetensors").exists()
    runner = load_runner(sharded, dtype="float32", num_kv_blocks=8)
    assert torch.equal(_logits(runner), _logits(make_runner("llama")))


def test_tied_checkpoint_without_lm_head_tensor_shares_the_embedding(
    tiny_checkpoint: CheckpointFactory,
) -> None:
    model_dir = tiny_checkpoint("llama_tied")
    assert "lm_head.weight" not in load_file(model_dir / "model.safetensors")
    model = load_model(model_dir, dtype="float32")
    assert model.lm_head.weight is model.embed_tokens.weight


def test_untied_checkpoint_keeps_a_separate_lm_head(tiny_checkpoint: CheckpointFactory) -> None:
    model = load_model(tiny_checkpoint("llama"), dtype="float32")
    assert model.lm_head.weight.data_ptr() != model.embed_tokens.weight.data_ptr()
    tensors = load_file(tiny_checkpoint("llama") / "model.safetensors")
    assert torch.equal(model.lm_head.weight, tensors["lm_head.weight"])
    assert torch.equal(model.norm.weight, tensors["model.norm.weight"])


@pytest.mark.parametrize(
    ("declared", "key", "expected"),
    [
        ("bfloat16", "dtype", torch.bfloat16),
        ("float16", "torch_dtype", torch.float16),  # the pre-transformers-5 key
        (None, "dtype", torch.float32),  # nothing declared
    ],
)
def test_auto_dtype_follows_the_checkpoint_and_reaches_the_kv_cache(
    llama_copy: Path,
    make_runner: Callable[..., ModelRunner],
    declared: str | None,
    key: str,
    expected: torch.dtype,
) -> None:
    _edit_config(llama_copy, dtype=None, torch_dtype=None)
    _edit_config(llama_copy, **{key: declared})
    runner = load_runner(llama_copy, dtype="auto", num_kv_blocks=8)
    assert runner.dtype == expected
    assert runner.kv_cache.dtype == expected
    assert all(p.dtype == expected for p in runner.model.parameters())
    logits = _logits(runner)
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()
    reference = _logits(make_runner("llama"))
    tolerance = 0.0 if expected == torch.float32 else 0.3
    assert (logits - reference).abs().max().item() <= tolerance


@pytest.mark.parametrize("dtype", ["float8", "int8", "float64"])
def test_bad_dtype_is_a_model_load_error_naming_it(llama_copy: Path, dtype: str) -> None:
    with pytest.raises(ModelLoadError, match=f"dtype '{dtype}'"):
        load_model(llama_copy, dtype=dtype)


def test_bad_auto_dtype_from_config_is_a_model_load_error(llama_copy: Path) -> None:
    _edit_config(llama_copy, dtype="float8_e4m3fn")
    with pytest.raises(ModelLoadError, match=r"float8_e4m3fn.*torch_dtype"):
        load_model(llama_copy)


@pytest.mark.parametrize("device", ["tpu", "not a device"])
def test_bad_device_is_a_model_load_error(llama_copy: Path, device: str) -> None:
    with pytest.raises(ModelLoadError, match="device"):
        load_model(llama_copy, device=device)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA error")
def test_cuda_without_cuda_is_a_model_load_error(llama_copy: Path) -> None:
    with pytest.raises(ModelLoadError, match="CUDA is not available"):
        load_model(llama_copy, device="cuda")


def test_missing_directory_is_a_model_load_error(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(tmp_path / "nope")


def test_missing_config_json_is_a_model_load_error_naming_it(llama_copy: Path) -> None:
    (llama_copy / "config.json").unlink()
    with pytest.raises(ModelLoadError, match=r"config\.json not found"):
        load_model(llama_copy)


def test_malformed_config_json_is_a_model_load_error(llama_copy: Path) -> None:
    (llama_copy / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="cannot read JSON"):
        load_model(llama_copy)


def test_missing_weights_is_a_model_load_error_naming_the_expected_files(llama_copy: Path) -> None:
    (llama_copy / "model.safetensors").rename(llama_copy / "weights.bin")
    with pytest.raises(ModelLoadError, match=r"model.safetensors nor model.safetensors.index.json"):
        load_model(llama_copy)


def test_missing_shard_is_a_model_load_error_naming_it(tmp_path: Path) -> None:
    sharded = write_tiny_model(tmp_path / "sharded", max_shard_size="100KB")
    victim = weight_files(sharded)[1]
    victim.unlink()
    with pytest.raises(ModelLoadError, match=victim.name):
        load_model(sharded)


def test_checkpoint_lacking_a_tensor_is_a_model_load_error_naming_it(llama_copy: Path) -> None:
    path = llama_copy / "model.safetensors"
    tensors = load_file(path)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, path)
    with pytest.raises(ModelLoadError, match=re.escape("model.layers.1.mlp.up_proj.weight")):
        load_model(llama_copy)


def test_unknown_tensor_is_a_model_load_error_naming_it(llama_copy: Path) -> None:
    path = llama_copy / "model.safetensors"
    tensors = load_file(path)
    tensors["model.layers.0.self_attn.q_norm.weight"] = torch.ones(16)
    save_file(tensors, path)
    with pytest.raises(ModelLoadError, match="q_norm"):
        load_model(llama_copy)


def test_bias_tensor_for_a_model_without_bias_is_a_model_load_error(llama_copy: Path) -> None:
    path = llama_copy / "model.safetensors"
    tensors = load_file(path)
    tensors["model.layers.0.self_attn.k_proj.bias"] = torch.zeros(32)
    save_file(tensors, path)
    with pytest.raises(ModelLoadError, match=r"k_proj\.bias' has no place in LlamaForCausalLM"):
        load_model(llama_copy)


def test_stored_rotary_inv_freq_of_old_checkpoints_is_ignored(llama_copy: Path) -> None:
    path = llama_copy / "model.safetensors"
    tensors = load_file(path)
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    save_file(tensors, path)
    assert torch.equal(
        load_model(llama_copy).layers[0].self_attn.qkv_proj.weight[:64],
        tensors["model.layers.0.self_attn.q_proj.weight"],
    )


def test_tensor_of_the_wrong_shape_is_a_model_load_error(llama_copy: Path) -> None:
    _edit_config(llama_copy, intermediate_size=96)
    with pytest.raises(
        ModelLoadError, match=r"mlp\.\w+_proj\.weight' has shape \(\d+, \d+\), expected"
    ):
        load_model(llama_copy)


def test_unsupported_architecture_is_an_unsupported_model_error(llama_copy: Path) -> None:
    _edit_config(llama_copy, architectures=["GPT2LMHeadModel"], model_type="gpt2")
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel"):
        load_runner(llama_copy, num_kv_blocks=8)


def test_runner_sizes_its_cache_from_blocks_or_a_byte_budget(llama_copy: Path) -> None:
    by_budget = load_runner(
        llama_copy,
        block_size=8,
        num_kv_blocks=None,
        kv_cache_memory=10 * 4096 + 100,
        max_model_len=72,
    )
    # tiny llama: 2 layers * (K, V) * 8 tokens * 2 KV heads * 16 dims * 4 bytes = 4096 per block
    assert by_budget.num_blocks == 10 and by_budget.kv_cache.shape == (2, 2, 10, 8, 2, 16)
    by_blocks = load_runner(llama_copy, block_size=8, num_kv_blocks=12)
    assert by_blocks.num_blocks == 12 and by_blocks.max_model_len == 88
    with pytest.raises(ValueError, match="exclusive"):
        load_runner(llama_copy, num_kv_blocks=8, kv_cache_memory=1 << 20)


def test_a_cache_too_small_for_one_full_sequence_is_refused(llama_copy: Path) -> None:
    with pytest.raises(
        ValueError, match=r"fewer than the 32 one sequence may need \(max_model_len=512,"
    ):
        load_runner(llama_copy, num_kv_blocks=8, max_model_len=512)


def test_tokenizer_loads_locally_and_a_missing_one_is_a_model_load_error(llama_copy: Path) -> None:
    assert load_tokenizer(llama_copy).decode([463]) != ""
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (llama_copy / name).unlink()
    with pytest.raises(ModelLoadError, match="tokenizer"):
        load_tokenizer(llama_copy)
