"""The model over the Triton kernels (the CUDA path), run here under the Triton interpreter:
the same tokens as transformers, with batching, chunked prefill and copy-on-write."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from transformers import PreTrainedModel

from pagedserve.kernels.ops import FORCE_TRITON_ENV
from services.executor.model.runner import ModelRunner

from .greedy import BlockAllocator, GreedySeq, hf_greedy, run_greedy

MAX_NEW_TOKENS = 6


@pytest.mark.parametrize(
    "name",
    [
        "llama",
        "qwen2",
        # Sliding windows crossed by the prompts (a sliding pool for Mistral: null entries in
        # the tables), soft-capping and GeGLU (Gemma 2), QK-norm with (1 + w) norms and a
        # RoPE base per layer type (Gemma 3), partial rotary with LongRoPE (Phi-4-mini).
        "mistral_window",
        "gemma2",
        "gemma3",
        "phi4_mini",
    ],
)
def test_triton_kernels_give_transformers_tokens_for_batched_chunked_prefill(
    name: str,
    monkeypatch: pytest.MonkeyPatch,
    make_runner: Callable[..., ModelRunner],
    hf_model: Callable[[str], PreTrainedModel],
    prompt_ids: list[list[int]],
) -> None:
    monkeypatch.setenv(FORCE_TRITON_ENV, "1")
    runner = make_runner(name, block_size=8, num_blocks=32)
    prompts = prompt_ids[:3]
    if name == "phi4_mini":  # LongRoPE's long factors, as transformers uses past 64 positions
        prompts = [[1, *[t for p in prompt_ids for t in p[1:]][:70]]]
    seqs = [GreedySeq(p, MAX_NEW_TOKENS) for p in prompts]
    run_greedy(runner, seqs, allocator=BlockAllocator(runner.num_blocks), chunk_size=16)
    for seq, prompt in zip(seqs, prompts, strict=True):
        ref_tokens, ref_logits = hf_greedy(hf_model(name), prompt, MAX_NEW_TOKENS)
        assert seq.output == ref_tokens
        for ours, ref in zip(seq.logits, ref_logits, strict=True):
            assert (ours - ref).abs().max().item() < 1e-4


def test_triton_copy_blocks_copies_every_layer_k_and_v(
    monkeypatch: pytest.MonkeyPatch, make_runner: Callable[..., ModelRunner]
) -> None:
    monkeypatch.setenv(FORCE_TRITON_ENV, "1")
    runner = make_runner("llama", block_size=8, num_blocks=8)
    runner.kv_cache.copy_(torch.randn(runner.kv_cache.shape))
    expected = runner.kv_cache.clone()
    expected[:, :, [5, 6]] = expected[:, :, [1, 3]]
    runner.copy_blocks([(1, 5), (3, 6)])
    assert torch.equal(runner.kv_cache, expected)
