"""The tiny checkpoint writer: real tokenizer, deterministic files, useful random weights, CLI."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from pagedserve.tools.tiny_model import LLAMA_CHAT_TEMPLATE, write_tiny_model
from services import cli
from services.executor.model.loader import load_tokenizer, read_model_config
from services.executor.model.runner import ModelRunner

from .conftest import CheckpointFactory, load_runner
from .greedy import BlockAllocator, GreedySeq, run_greedy

ROUND_TRIP_TEXTS = [
    "The morning train left the station.",
    "  leading spaces, tabs\tand\nnewlines  ",
    "Café crème brûlée, naïve façade",
    "日本語のテキスト and 中文",
    "emoji 🙂🚀 and combining e\u0301 and ZWJ 👩\u200d💻",
    "",
]


@pytest.mark.parametrize("text", ROUND_TRIP_TEXTS)
def test_tokenizer_round_trips_text_including_multibyte_utf8(
    tiny_checkpoint: CheckpointFactory, text: str
) -> None:
    tokenizer = load_tokenizer(tiny_checkpoint("llama"))
    ids = tokenizer(text).input_ids
    assert ids[0] == tokenizer.bos_token_id
    assert tokenizer.decode(ids, skip_special_tokens=True) == text
    assert tokenizer.decode(ids[1:]) == text


def test_tokenizer_has_bos_eos_pad_and_matches_the_model_vocab(
    tiny_checkpoint: CheckpointFactory,
) -> None:
    model_dir = tiny_checkpoint("llama")
    tokenizer = load_tokenizer(model_dir)
    config = read_model_config(model_dir)
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token) == (
        "<s>",
        "</s>",
        "<pad>",
    )
    assert config.bos_token_id == tokenizer.bos_token_id
    assert config.eos_token_ids == (tokenizer.eos_token_id,)
    assert len(tokenizer) == config.vocab_size
    assert 512 <= config.vocab_size <= 1024
    # A trained BPE, not a byte table: common words are single tokens.
    assert len(tokenizer("the train", add_special_tokens=False).input_ids) == 2
    generation = json.loads((model_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == tokenizer.eos_token_id


def test_chat_template_renders_and_tokenizes_with_one_bos(
    tiny_checkpoint: CheckpointFactory,
) -> None:
    tokenizer = load_tokenizer(tiny_checkpoint("llama"))
    assert tokenizer.chat_template == LLAMA_CHAT_TEMPLATE
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello!"},
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "<s><|system|>\nBe brief.</s>\n<|user|>\nHello!</s>\n<|assistant|>\n"
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)["input_ids"]
    assert ids.count(tokenizer.bos_token_id) == 1 and ids[0] == tokenizer.bos_token_id
    assert tokenizer.convert_ids_to_tokens(ids[-2]) == "<|assistant|>"


def test_same_seed_writes_byte_identical_files_and_another_seed_other_weights(
    tmp_path: Path,
) -> None:
    a = write_tiny_model(tmp_path / "a", arch="qwen2", seed=11)
    b = write_tiny_model(tmp_path / "b", arch="qwen2", seed=11)
    c = write_tiny_model(tmp_path / "c", arch="qwen2", seed=12)
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir())
    assert {
        "config.json",
        "model.safetensors",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
    } <= set(names)
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()
    assert (a / "tokenizer.json").read_bytes() == (c / "tokenizer.json").read_bytes()


@pytest.mark.parametrize("name", ["llama", "qwen2", "mistral"])
def test_random_weights_give_greedy_outputs_that_vary_with_the_prompt(
    name: str, make_runner: Callable[..., ModelRunner], tiny_checkpoint: CheckpointFactory
) -> None:
    tokenizer = load_tokenizer(tiny_checkpoint(name))
    texts = [
        "The",
        "A cup of tea",
        "Computers store text",
        "She asked him",
        "In the spring",
        "How does a server",
        "Numbers and dates",
        "The old sailor",
    ]
    runner = make_runner(name)
    seqs = [GreedySeq(tokenizer(t).input_ids, 10) for t in texts]
    run_greedy(runner, seqs, allocator=BlockAllocator(runner.num_blocks))
    outputs = [tuple(s.output) for s in seqs]
    assert len(set(outputs)) == len(outputs), "two prompts gave the same continuation"
    assert all(len(set(o)) >= 4 for o in outputs), f"a continuation repeats itself: {outputs}"
    assert len({t for o in outputs for t in o}) >= 30
    first_tokens = {o[0] for o in outputs}
    assert len(first_tokens) >= 4


def test_architectures_write_the_configs_our_executor_accepts(
    tiny_checkpoint: CheckpointFactory,
) -> None:
    mistral = json.loads((tiny_checkpoint("mistral") / "config.json").read_text())
    assert mistral["sliding_window"] is None  # no window unless asked for
    assert read_model_config(tiny_checkpoint("mistral_window")).sliding_layers == (0, 1)
    qwen2 = json.loads((tiny_checkpoint("qwen2") / "config.json").read_text())
    assert qwen2["use_sliding_window"] is False
    assert read_model_config(tiny_checkpoint("qwen2_window")).sliding_layers == (1,)
    gemma3 = read_model_config(tiny_checkpoint("gemma3"))
    assert (gemma3.sliding_layers, gemma3.sliding_window) == ((0,), 16)
    assert read_model_config(tiny_checkpoint("qwen2")).qkv_bias
    assert read_model_config(tiny_checkpoint("llama3_rope")).rope.rope_type == "llama3"
    assert read_model_config(tiny_checkpoint("llama_tied")).tie_word_embeddings


def test_cli_make_tiny_model_writes_a_loadable_checkpoint(tmp_path: Path) -> None:
    out = tmp_path / "cli-model"
    argv = ["make-tiny-model", str(out), "--arch", "mistral", "--seed", "5", "--num-layers", "3"]
    assert cli.main(argv) == 0
    config = read_model_config(out)
    assert (config.architecture, config.num_layers) == ("MistralForCausalLM", 3)
    runner = load_runner(out, num_kv_blocks=4)
    assert runner.model.config.vocab_size == len(load_tokenizer(out))


def test_cli_refuses_a_non_empty_directory_without_force(tmp_path: Path) -> None:
    (tmp_path / "keep.txt").write_text("precious")
    with pytest.raises(SystemExit) as info:
        cli.main(["make-tiny-model", str(tmp_path)])
    assert info.value.code == 2
    assert cli.main(["make-tiny-model", str(tmp_path), "--force"]) == 0
    assert (tmp_path / "config.json").is_file() and (tmp_path / "keep.txt").is_file()


def test_cli_make_tiny_model_lora_writes_a_peft_adapter_the_executor_reads(tmp_path: Path) -> None:
    from services.executor.model.lora.adapter import read_adapter

    base = tmp_path / "base"
    assert cli.main(["make-tiny-model", str(base), "--arch", "phi3"]) == 0
    out = tmp_path / "adapter"
    argv = ["make-tiny-model", str(out), "--lora", str(base), "--lora-rank", "4", "--use-rslora"]
    assert cli.main(argv) == 0
    config = json.loads((out / "adapter_config.json").read_text())
    assert (config["r"], config["use_rslora"], config["init_lora_weights"]) == (4, True, False)
    model = load_runner(base, num_kv_blocks=4).model
    adapter = read_adapter(out, model.config, model.dtype, 4)
    assert adapter.rank == 4
    qkv = adapter.modules[(0, "self_attn.qkv_proj")]  # Phi-3's fused module, as PEFT targets it
    assert [m.parts for m in qkv] == [(0, 1, 2)] and qkv[0].b.abs().sum() > 0
