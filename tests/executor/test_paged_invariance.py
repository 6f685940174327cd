"""Paging is invisible to the results: the same tokens whatever the batching, block size,
prefill chunking, prefix-cache reuse, copy-on-write fork or stale cache contents."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from transformers import PreTrainedModel

from services.executor.model.runner import ModelRunner

from .greedy import BlockAllocator, GreedySeq, greedy_alone, hf_greedy, run_greedy

MAX_NEW_TOKENS = 12
NAME = "llama"


@pytest.fixture
def hf_tokens(
    hf_model: Callable[[str], PreTrainedModel], prompt_ids: list[list[int]]
) -> list[list[int]]:
    """transformers' greedy continuation of each prompt."""
    return [hf_greedy(hf_model(NAME), p, MAX_NEW_TOKENS)[0] for p in prompt_ids]


def test_batched_sequences_of_different_lengths_match_each_alone(
    make_runner: Callable[..., ModelRunner], prompt_ids: list[list[int]], hf_tokens: list[list[int]]
) -> None:
    runner = make_runner(NAME)
    alone = [greedy_alone(runner, p, MAX_NEW_TOKENS) for p in prompt_ids]
    # Staggered arrivals: steps mix whole prefills with other sequences' decodes.
    batched = [
        GreedySeq(p, MAX_NEW_TOKENS, start_step=s)
        for p, s in zip(prompt_ids, (0, 0, 2, 5), strict=True)
    ]
    run_greedy(runner, batched, allocator=BlockAllocator(runner.num_blocks, seed=1))
    for one, many, ref in zip(alone, batched, hf_tokens, strict=True):
        assert many.output == one.output == ref
        for a, b in zip(one.logits, many.logits, strict=True):
            assert (a - b).abs().max().item() < 1e-4


@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_tokens_identical_for_any_block_size(
    block_size: int,
    make_runner: Callable[..., ModelRunner],
    prompt_ids: list[list[int]],
    hf_tokens: list[list[int]],
) -> None:
    runner = make_runner(NAME, block_size=block_size, num_blocks=64)
    seqs = [GreedySeq(p, MAX_NEW_TOKENS) for p in prompt_ids]
    run_greedy(runner, seqs, allocator=BlockAllocator(runner.num_blocks))
    assert [s.output for s in seqs] == hf_tokens


@pytest.mark.parametrize("chunk_size", [1, 7, 16])
def test_tokens_identical_for_any_prefill_chunking(
    chunk_size: int,
    make_runner: Callable[..., ModelRunner],
    prompt_ids: list[list[int]],
    hf_tokens: list[list[int]],
) -> None:
    runner = make_runner(NAME, block_size=8)
    # Batched: short prompts finish prefill and decode while long ones are still chunking.
    seqs = [GreedySeq(p, MAX_NEW_TOKENS) for p in prompt_ids]
    run_greedy(runner, seqs, allocator=BlockAllocator(runner.num_blocks), chunk_size=chunk_size)
    assert [s.output for s in seqs] == hf_tokens


def test_prefix_cache_hit_reuses_first_sequences_full_blocks(
    make_runner: Callable[..., ModelRunner],
    hf_model: Callable[[str], PreTrainedModel],
    prompt_ids: list[list[int]],
) -> None:
    runner = make_runner(NAME, block_size=8)
    allocator = BlockAllocator(runner.num_blocks)
    long = max(prompt_ids, key=len)
    shared = long[:32]  # four full blocks
    first = GreedySeq(long, MAX_NEW_TOKENS)
    run_greedy(runner, [first], allocator=allocator, chunk_size=5)
    shared_blocks = first.block_table[:4]
    before = runner.kv_cache[:, :, shared_blocks].clone()

    # The second prompt shares the first 32 tokens, then diverges. It arrives while the
    # first is still running (a copy that keeps decoding) and computes only its own tail.
    second_prompt = shared + prompt_ids[1][1:]
    rerun = GreedySeq(long, MAX_NEW_TOKENS)
    second = GreedySeq(
        second_prompt,
        MAX_NEW_TOKENS,
        block_table=list(shared_blocks),
        num_computed_tokens=32,
        start_step=3,
    )
    run_greedy(runner, [rerun, second], allocator=allocator)

    assert second.output == hf_greedy(hf_model(NAME), second_prompt, MAX_NEW_TOKENS)[0]
    assert rerun.output == first.output
    assert second.block_table[:4] == shared_blocks
    assert not set(second.block_table[4:]) & set(first.block_table + rerun.block_table)
    assert torch.equal(runner.kv_cache[:, :, shared_blocks], before), "shared blocks written"


def test_copy_on_write_fork_decodes_like_its_parent(
    make_runner: Callable[..., ModelRunner], prompt_ids: list[list[int]], hf_tokens: list[list[int]]
) -> None:
    runner = make_runner(NAME, block_size=16)
    allocator = BlockAllocator(runner.num_blocks)
    prompt, ref = prompt_ids[1], hf_tokens[1]  # 25 tokens: one full block + a partial one
    parent = GreedySeq(prompt, MAX_NEW_TOKENS)
    run_greedy(runner, [parent], allocator=allocator, num_steps=1)  # prefill only
    assert parent.num_computed_tokens == len(prompt) and parent.output == ref[:1]

    # Fork: share the full block, copy the partial one the fork is about to write into.
    (copy,) = allocator.allocate(1)
    runner.copy_blocks([(parent.block_table[1], copy)])
    assert torch.equal(runner.kv_cache[:, :, copy], runner.kv_cache[:, :, parent.block_table[1]])
    child = GreedySeq(
        prompt,
        MAX_NEW_TOKENS,
        block_table=[parent.block_table[0], copy],
        num_computed_tokens=len(prompt),
        output=list(parent.output),
    )
    child.logits = list(parent.logits)
    run_greedy(runner, [parent, child], allocator=allocator)
    assert parent.output == child.output == ref
    assert parent.block_table[1] != child.block_table[1]


def test_stale_and_nan_cache_contents_never_leak_into_results(
    make_runner: Callable[..., ModelRunner], prompt_ids: list[list[int]], hf_tokens: list[list[int]]
) -> None:
    runner = make_runner(NAME, block_size=16)
    runner.kv_cache.fill_(float("nan"))  # also the padding block 0 and unwritten slots
    seqs = [GreedySeq(p, MAX_NEW_TOKENS) for p in prompt_ids]
    run_greedy(runner, seqs, allocator=BlockAllocator(runner.num_blocks))
    assert [s.output for s in seqs] == hf_tokens
    assert all(torch.isfinite(row).all() for s in seqs for row in s.logits)
