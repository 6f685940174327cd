"""The families beyond Llama (sliding windows, Gemma 2/3, Phi-4-mini's LongRoPE) match
transformers token for token however the work is cut: batched with prefill chunks, from a
prefix of cached blocks, and through the engine's scheduler with prefix caching, chunked
prefill and preemption all in play."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from transformers import PreTrainedModel

from services.blockmgr.client import InProcessClient
from services.common.sampling_params import SamplingParams
from services.executor.core.sequence import RequestKey
from services.executor.model.launch import build_runner
from services.executor.model.runner import ModelRunner
from services.executor.service.config import ExecutorConfig
from services.executor.service.startup import build_engine

from .conftest import WINDOWED, CheckpointFactory, load_runner
from .greedy import BlockAllocator, GreedySeq, hf_greedy, run_greedy, shared_prefix_workload

MAX_NEW_TOKENS = 12


@pytest.mark.parametrize("name", WINDOWED)
def test_batched_sequences_with_chunked_prefill_match_transformers(
    name: str,
    make_runner: Callable[..., ModelRunner],
    hf_model: Callable[[str], PreTrainedModel],
    prompt_ids: list[list[int]],
) -> None:
    """Prefill chunks of 5 tokens in 8-token blocks, staggered arrivals: windows of 16 start
    and end inside blocks and inside chunks."""
    runner = make_runner(name, block_size=8)
    seqs = [
        GreedySeq(p, MAX_NEW_TOKENS, start_step=s)
        for p, s in zip(prompt_ids, (0, 1, 0, 3), strict=True)
    ]
    run_greedy(runner, seqs, allocator=BlockAllocator(runner.num_blocks), chunk_size=5)
    for seq, prompt in zip(seqs, prompt_ids, strict=True):
        assert seq.output == hf_greedy(hf_model(name), prompt, MAX_NEW_TOKENS)[0]


@pytest.mark.parametrize("name", ["mistral_window", "gemma3"])
def test_a_prefix_hit_past_the_window_continues_as_transformers_does(
    name: str,
    make_runner: Callable[..., ModelRunner],
    hf_model: Callable[[str], PreTrainedModel],
    prompt_ids: list[list[int]],
) -> None:
    """A second sequence starts from the first one's cached full blocks (32 tokens, twice the
    window) and computes only its tail: its queries see the window inside the cached part."""
    runner = make_runner(name, block_size=8)
    allocator = BlockAllocator(runner.num_blocks)
    prompt = max(prompt_ids, key=len)
    first = GreedySeq(prompt, 1)
    run_greedy(runner, [first], allocator=allocator)
    cached = 32
    assert len(prompt) > cached + 2
    second = GreedySeq(prompt, MAX_NEW_TOKENS, block_table=first.block_table[: cached // 8])
    second.num_computed_tokens = cached
    run_greedy(runner, [second], allocator=allocator)
    assert second.output == hf_greedy(hf_model(name), prompt, MAX_NEW_TOKENS)[0]


@pytest.mark.parametrize(
    ("name", "hybrid", "num_kv_blocks"),
    [
        # Too few for all at once: sequences are preempted and recomputed. Gemma 3's pool is
        # hybrid (a sliding and a full group, each block one layer: twice the blocks in the
        # same memory); Gemma 2's keeps every block of every layer; Mistral's releases the
        # blocks out of its window (it needs fewer to be short of them).
        ("gemma3", True, 26),
        ("gemma2", False, 14),
        ("mistral_window", True, 8),
    ],
)
def test_engine_with_prefix_caching_chunked_prefill_and_preemption_matches_transformers(
    name: str,
    hybrid: bool,
    num_kv_blocks: int,
    tiny_checkpoint: CheckpointFactory,
    hf_model: Callable[[str], PreTrainedModel],
) -> None:
    workload = shared_prefix_workload(
        hf_model(name), seed=3, num_requests=12, prefix_len=40, max_tail=30, max_tokens=(4, 24)
    )
    config = ExecutorConfig(
        model=str(tiny_checkpoint(name)),
        dtype="float32",
        device="cpu",
        block_size=8,
        num_kv_blocks=num_kv_blocks,
        max_model_len=96,
        max_num_batched_tokens=24,  # prompts are prefilled in chunks
        disable_hybrid_kv_cache_manager=not hybrid,
    )
    engine, _ = build_engine(
        config, runner=build_runner(config.runner_config()), blockmgr=InProcessClient()
    )
    got: dict[str, list[int]] = {}
    for i, (prompt, max_tokens, _) in enumerate(workload):
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
        engine.add_request(RequestKey(0, f"r{i}"), prompt, params)
    while engine.has_work:
        for out in engine.step():
            got.setdefault(out.req_id.request_id, []).extend(out.token_ids)
    for i, (_, _, expected) in enumerate(workload):
        assert got[f"r{i}"] == expected, f"request r{i}"
    stats = engine.link.client.stats(engine.link.pool_id)
    assert stats.prefix_cache_hits_tokens > 0
    assert engine.scheduler.num_preemptions > 0
    assert engine.scheduler.config.num_kv_groups == (2 if name == "gemma3" else 1)


def _long_prompts(prompt_ids: list[list[int]]) -> list[list[int]]:
    """Prompts longer than the LongRoPE checkpoint's original context (64 positions)."""
    joined = [t for p in prompt_ids for t in p[1:]]
    return [[1, *joined[:70]], [1, *joined[5:90]]]


def test_longrope_uses_the_short_factors_when_the_served_context_fits_the_original(
    tiny_checkpoint: CheckpointFactory,
    hf_model: Callable[[str], PreTrainedModel],
    prompt_ids: list[list[int]],
) -> None:
    runner = load_runner(tiny_checkpoint("phi4_mini"), dtype="float32", max_model_len=64)
    prompts = [p for p in prompt_ids if len(p) + MAX_NEW_TOKENS <= 64]
    assert len(prompts) >= 3
    seqs = [GreedySeq(p, MAX_NEW_TOKENS) for p in prompts]
    run_greedy(runner, seqs, allocator=BlockAllocator(runner.num_blocks), chunk_size=7)
    for seq, prompt in zip(seqs, prompts, strict=True):
        assert seq.output == hf_greedy(hf_model("phi4_mini"), prompt, MAX_NEW_TOKENS)[0]


def test_longrope_uses_the_long_factors_for_a_longer_served_context(
    tiny_checkpoint: CheckpointFactory,
    hf_model: Callable[[str], PreTrainedModel],
    prompt_ids: list[list[int]],
) -> None:
    """transformers picks the long factors once a sequence passes 64 positions; served with
    max_model_len > 64 we always use them, so sequences longer than 64 agree."""
    runner = load_runner(tiny_checkpoint("phi4_mini"), dtype="float32", max_model_len=256)
    prompts = _long_prompts(prompt_ids)
    seqs = [GreedySeq(p, MAX_NEW_TOKENS) for p in prompts]
    run_greedy(runner, seqs, allocator=BlockAllocator(runner.num_blocks), chunk_size=16)
    for seq, prompt in zip(seqs, prompts, strict=True):
        ref, ref_logits = hf_greedy(hf_model("phi4_mini"), prompt, MAX_NEW_TOKENS)
        assert seq.output == ref
        assert (seq.logits[0] - ref_logits[0]).abs().max().item() < 1e-4


def test_gemma3_multimodal_checkpoint_serves_its_language_model_without_the_vision_tower(
    tiny_checkpoint: CheckpointFactory,
) -> None:
    runner = load_runner(tiny_checkpoint("gemma3_mm"), dtype="float32")
    names = {n for n, _ in runner.model.named_parameters()}
    assert not any("vision" in n or "projector" in n for n in names)
    assert runner.config.architecture == "Gemma3ForConditionalGeneration"
    assert runner.config.sliding_layers == (0,) and runner.config.sliding_window == 16


def test_gemma_norms_use_unit_offset_gains_and_a_scaled_embedding(
    tiny_checkpoint: CheckpointFactory,
) -> None:
    c = load_runner(tiny_checkpoint("gemma3"), dtype="float32").config
    assert c.norm_unit_offset and c.qk_norm and c.hidden_act == "gelu_tanh"
    assert c.embed_scale == pytest.approx(8.0) and c.attention_scale == pytest.approx(24**-0.5)
    assert c.sliding_rope is not None and c.sliding_rope.theta != c.rope.theta
    with torch.no_grad():
        g2 = load_runner(tiny_checkpoint("gemma2"), dtype="float32").config
    assert (g2.attn_logit_softcap, g2.final_logit_softcap) == (5.0, 3.0)
