"""Our paged runner against transformers on the same checkpoints: identical greedy tokens,
logits within 1e-4 (fp32), for every model variant we support."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from transformers import PreTrainedModel

from services.executor.model.forward_batch import SeqChunk
from services.executor.model.runner import ModelRunner

from .conftest import CHECKPOINTS, LONGROPE
from .greedy import BlockAllocator, GreedySeq, greedy_alone, hf_greedy, run_greedy

MAX_NEW_TOKENS = 12
ATOL = 1e-4


def _max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


@pytest.mark.parametrize("name", [n for n in CHECKPOINTS if n not in LONGROPE])
def test_greedy_generation_token_identical_and_logits_within_1e4_of_transformers(
    name: str,
    make_runner: Callable[..., ModelRunner],
    hf_model: Callable[[str], PreTrainedModel],
    prompt_ids: list[list[int]],
) -> None:
    runner = make_runner(name)  # one runner, reused: stale blocks from earlier prompts stay
    for prompt in prompt_ids:
        ref_tokens, ref_logits = hf_greedy(hf_model(name), prompt, MAX_NEW_TOKENS)
        seq = greedy_alone(runner, prompt, MAX_NEW_TOKENS)
        assert seq.output == ref_tokens, f"prompt of {len(prompt)} tokens"
        assert len(seq.logits) == len(ref_logits)
        for step, (ours, ref) in enumerate(zip(seq.logits, ref_logits, strict=True)):
            assert _max_abs(ours, ref) < ATOL, f"prompt of {len(prompt)} tokens, step {step}"


@pytest.mark.parametrize(
    "name",
    [
        "llama",
        "llama3_rope",
        "qwen2",
        "llama_head_dim",
        "qwen3",
        "mixtral",
        "qwen3_moe",
        "phi3",
        "mistral_window",
        "gemma2",
        "gemma3",
    ],
)
def test_prefill_token_by_token_logits_match_transformers_forward_at_every_position(
    name: str,
    make_runner: Callable[..., ModelRunner],
    hf_model: Callable[[str], PreTrainedModel],
    prompt_ids: list[list[int]],
) -> None:
    runner = make_runner(name, block_size=8)
    prompt = max(prompt_ids, key=len)
    with torch.inference_mode():
        ref = hf_model(name)(torch.tensor([prompt])).logits[0].float()  # [len, V]
    block_table = BlockAllocator(runner.num_blocks).allocate(-(-len(prompt) // 8))
    for pos, token in enumerate(prompt):
        (ours,) = runner.execute([SeqChunk([token], pos, block_table, need_logits=True)])
        assert _max_abs(ours, ref[pos]) < ATOL, f"position {pos}"


def test_logits_are_returned_only_for_chunks_that_need_them_in_chunk_order(
    make_runner: Callable[..., ModelRunner],
    hf_model: Callable[[str], PreTrainedModel],
    prompt_ids: list[list[int]],
) -> None:
    runner = make_runner("llama")
    blocks = BlockAllocator(runner.num_blocks)
    chunks = [
        SeqChunk(p, 0, blocks.allocate(-(-len(p) // 16)), need_logits=i % 2 == 1)
        for i, p in enumerate(prompt_ids)
    ]
    logits = runner.execute(chunks)
    wanted = [p for i, p in enumerate(prompt_ids) if i % 2 == 1]
    assert logits.shape == (len(wanted), runner.config.vocab_size)
    assert logits.dtype == torch.float32
    with torch.inference_mode():
        for row, prompt in zip(logits, wanted, strict=True):
            ref = hf_model("llama")(torch.tensor([prompt])).logits[0, -1]
            assert _max_abs(row, ref) < ATOL


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe"])
def test_a_mixture_of_experts_batched_with_chunked_prefill_gives_transformers_tokens(
    name: str,
    make_runner: Callable[..., ModelRunner],
    hf_model: Callable[[str], PreTrainedModel],
    prompt_ids: list[list[int]],
) -> None:
    """Tokens of several sequences, prefill chunks and decodes, share each forward: every
    token is still routed to its own experts."""
    runner = make_runner(name)
    seqs = [GreedySeq(p, MAX_NEW_TOKENS) for p in prompt_ids]
    run_greedy(runner, seqs, allocator=BlockAllocator(runner.num_blocks), chunk_size=5)
    for seq, prompt in zip(seqs, prompt_ids, strict=True):
        assert seq.output == hf_greedy(hf_model(name), prompt, MAX_NEW_TOKENS)[0]
