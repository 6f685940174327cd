"""Fixtures: tiny checkpoints written once per session, their HF reference models, runners."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, PreTrainedModel

from pagedserve.tools.tiny_model import TinyModelSpec, write_tiny_model
from services.executor.model.launch import build_runner
from services.executor.model.loader import load_tokenizer
from services.executor.model.runner import ModelRunner
from services.executor.service.config import ExecutorConfig

from .greedy import PROMPT_TEXTS

MAX_POSITIONS = TinyModelSpec().max_position_embeddings

# name -> write_tiny_model arguments. Distinct seeds, so no two checkpoints share weights.
CHECKPOINTS: dict[str, dict[str, Any]] = {
    "llama": {"arch": "llama", "seed": 1},
    "llama_tied": {"arch": "llama", "seed": 2, "tie_word_embeddings": True},
    "llama3_rope": {"arch": "llama", "seed": 3, "rope_scaling": "llama3"},
    "llama_linear_rope": {"arch": "llama", "seed": 4, "rope_scaling": "linear"},
    "llama_head_dim": {"arch": "llama", "seed": 5, "head_dim": 32, "num_kv_heads": 1},
    "qwen2": {"arch": "qwen2", "seed": 6},
    "qwen2_tied": {"arch": "qwen2", "seed": 7, "tie_word_embeddings": True},
    "mistral": {"arch": "mistral", "seed": 8},
    # Qwen3: QK-norm, and an explicit head_dim with q_size != hidden_size; tied embeddings.
    "qwen3": {"arch": "qwen3", "seed": 11, "head_dim": 32},
    "qwen3_tied": {"arch": "qwen3", "seed": 12, "tie_word_embeddings": True},
    # Mixtures of experts: 4 experts, top-2; Qwen3-MoE with a dense first layer.
    "mixtral": {"arch": "mixtral", "seed": 13},
    "qwen3_moe": {"arch": "qwen3_moe", "seed": 14},
    "phi3": {"arch": "phi3", "seed": 15},
    # Sliding windows of 16 tokens, which the longer prompts cross: on every layer (Mistral,
    # Phi-3), from layer 1 on (Qwen2), or on alternate layers with global ones between (Gemma).
    "mistral_window": {"arch": "mistral", "seed": 16, "sliding_window": 16},
    "qwen2_window": {"arch": "qwen2", "seed": 17, "sliding_window": 16},
    "phi3_window": {"arch": "phi3", "seed": 18, "sliding_window": 16},
    # Gemma 2: soft-capped attention and logits; Gemma 3: QK-norm, a RoPE base per layer
    # type; both (1 + w) norms, four per layer, GeGLU, scaled embeddings.
    "gemma2": {"arch": "gemma2", "seed": 19},
    "gemma3": {"arch": "gemma3", "seed": 20, "head_dim": 32},
    "gemma3_tied": {"arch": "gemma3", "seed": 21, "tie_word_embeddings": True},
    "gemma3_mm": {"arch": "gemma3_mm", "seed": 22, "tie_word_embeddings": True},
    # Phi-4-mini's rotary: LongRoPE (original context 64) over 3/4 of each head.
    "phi4_mini": {
        "arch": "phi3",
        "seed": 23,
        "rope_scaling": "longrope",
        "partial_rotary_factor": 0.75,
        "tie_word_embeddings": True,
    },
    # For tensor parallelism: as many KV heads as query heads (4), so they split over 4 ranks;
    # and a vocabulary and an MLP width that 4 ranks do not divide.
    "llama_mha": {"arch": "llama", "seed": 9, "num_kv_heads": 4},
    "llama_odd_sizes": {"arch": "llama", "seed": 10, "extra_vocab": 2, "intermediate_size": 126},
}

#: Checkpoints whose LongRoPE factors depend on max_model_len (tested on their own).
LONGROPE = ("phi4_mini",)
#: The families added for sliding windows and Gemma, tested batched with chunked prefill.
WINDOWED = ("mistral_window", "qwen2_window", "phi3_window", "gemma2", "gemma3", "gemma3_mm")

CheckpointFactory = Callable[[str], Path]


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> CheckpointFactory:
    """``tiny_checkpoint(name)`` -> directory of that checkpoint, written on first use."""
    root = tmp_path_factory.mktemp("tiny_checkpoints")
    written: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in written:
            written[name] = write_tiny_model(root / name, **CHECKPOINTS[name])
        return written[name]

    return get


@pytest.fixture(scope="session")
def draft_checkpoint(
    tiny_checkpoint: CheckpointFactory, tmp_path_factory: pytest.TempPathFactory
) -> Callable[[str, float], Path]:
    """``draft_checkpoint(name, noise)`` -> a draft model for checkpoint ``name``: its copy
    with Gaussian noise of ``noise`` times each matrix's standard deviation added to every
    projection (not the embeddings), seeded. A tiny random model's greedy tokens are chaotic:
    a noise of 0.02 keeps about half of the drafts accepted, 0 all of them."""
    root = tmp_path_factory.mktemp("draft_checkpoints")
    written: dict[tuple[str, float], Path] = {}

    def get(name: str, noise: float) -> Path:
        if (name, noise) not in written:
            target, out = tiny_checkpoint(name), root / f"{name}-{noise}"
            shutil.copytree(target, out)
            gen = torch.Generator().manual_seed(7)
            for file in out.glob("*.safetensors"):
                weights = load_file(file)
                for key, w in weights.items():
                    if w.dim() == 2 and "embed" not in key:
                        noisy = w.float() + noise * w.float().std() * torch.randn(
                            w.shape, generator=gen
                        )
                        weights[key] = noisy.to(w.dtype)
                save_file(weights, file, metadata={"format": "pt"})
            written[(name, noise)] = out
        return written[(name, noise)]

    return get


@pytest.fixture(scope="session")
def eagle3_head(
    tiny_checkpoint: CheckpointFactory,
    hf_model: Callable[[str], PreTrainedModel],
    tmp_path_factory: pytest.TempPathFactory,
) -> Callable[[str], Path]:
    """``eagle3_head(name)`` -> an EAGLE-3 head for checkpoint ``name``, trained (seeded, a
    few seconds) on the model's greedy tokens after the prompts of the speculative tests
    (``test_speculative._requests(seed=1, ...)``), so that most of its drafts are accepted.
    It shares the target's embeddings."""
    from bench.common.eagle3 import train_eagle3_head
    from tests.executor.test_speculative import _requests

    root = tmp_path_factory.mktemp("eagle3_heads")
    written: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in written:
            model = hf_model(name)
            sequences = []
            for prompt, _ in _requests(seed=1, num=12).values():
                ids = torch.tensor([prompt])
                out = model.generate(
                    ids, attention_mask=torch.ones_like(ids), max_new_tokens=100, do_sample=False
                )
                sequences.append(out[0].tolist())
            out_dir = root / name
            train_eagle3_head(tiny_checkpoint(name), out_dir, sequences, steps=80, seed=0)
            written[name] = out_dir
        return written[name]

    return get


@pytest.fixture(scope="session")
def hf_model(tiny_checkpoint: CheckpointFactory) -> Callable[[str], PreTrainedModel]:
    """``hf_model(name)`` -> the transformers reference model of that checkpoint (fp32)."""
    models: dict[str, PreTrainedModel] = {}

    def get(name: str) -> PreTrainedModel:
        if name not in models:
            model = AutoModelForCausalLM.from_pretrained(
                tiny_checkpoint(name), dtype=torch.float32, local_files_only=True
            )
            models[name] = model.eval()
        return models[name]

    return get


def load_runner(model_dir: str | Path, **config: Any) -> ModelRunner:
    """A CPU runner of ``model_dir`` built the production way; ``config`` overrides
    :class:`ExecutorConfig` fields. ``max_model_len`` defaults to what the cache holds. The
    runner's callers give each sequence one block table: a hybrid model's KV cache is one
    group here (the engine tests serve it from hybrid pools)."""
    config.setdefault("device", "cpu")
    config.setdefault("disable_hybrid_kv_cache_manager", True)
    config.setdefault("num_kv_blocks", 128)
    if config["num_kv_blocks"] is not None:
        capacity = (config["num_kv_blocks"] - 1) * config.get("block_size", 16)
        config.setdefault("max_model_len", min(MAX_POSITIONS, capacity))
    return build_runner(ExecutorConfig(model=str(model_dir), **config).runner_config())


@pytest.fixture
def make_runner(tiny_checkpoint: CheckpointFactory) -> Callable[..., ModelRunner]:
    """``make_runner(name, block_size=16, num_blocks=128)`` -> a fresh fp32 CPU runner."""

    def make(name: str, *, block_size: int = 16, num_blocks: int = 128) -> ModelRunner:
        return load_runner(
            tiny_checkpoint(name), dtype="float32", block_size=block_size, num_kv_blocks=num_blocks
        )

    return make


@pytest.fixture(scope="session")
def prompt_ids(tiny_checkpoint: CheckpointFactory) -> list[list[int]]:
    """Token ids (with BOS) of ``greedy.PROMPT_TEXTS``; every tiny checkpoint shares the
    tokenizer. Lengths range from 3 to over 40 tokens (several 16-token blocks).
    """
    tokenizer = load_tokenizer(tiny_checkpoint("llama"))
    return [tokenizer(text).input_ids for text in PROMPT_TEXTS]


@pytest.fixture(scope="session")
def lora_adapter(
    tiny_checkpoint: CheckpointFactory, tmp_path_factory: pytest.TempPathFactory
) -> Callable[..., Path]:
    """``lora_adapter(name, seed, rank=8, use_rslora=False)`` -> a random PEFT adapter of
    checkpoint ``name`` (nonzero A and B: it changes the model's greedy tokens)."""
    from pagedserve.tools.lora_adapter import write_random_adapter

    root = tmp_path_factory.mktemp("lora_adapters")
    written: dict[tuple[str, int, int, bool], Path] = {}

    def get(name: str, seed: int, rank: int = 8, use_rslora: bool = False) -> Path:
        key = (name, seed, rank, use_rslora)
        if key not in written:
            out = root / f"{name}-{seed}-r{rank}{'-rs' if use_rslora else ''}"
            written[key] = write_random_adapter(
                tiny_checkpoint(name), out, rank=rank, use_rslora=use_rslora, seed=seed
            )
        return written[key]

    return get
