"""Preemption by swapping (``--preemption-mode swap``) through a real engine: a KV cache too
small for its batch swaps sequences out to the host tier and back, the tokens are
transformers' and the same as with recomputation, fewer prompt tokens are computed again, and
a block-manager restart with sequences swapped out restores them from their slots."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable
from typing import Any

import pytest
from transformers import PreTrainedModel

from services.blockmgr.api.protocol import BlockManagerClient
from services.blockmgr.api.types import (
    GrowResult,
    OpStatus,
    PoolSpec,
    StepResult,
    SwapInResult,
    SwapOutResult,
)
from services.blockmgr.client import InProcessClient
from services.common.sampling_params import SamplingParams
from services.executor.core.blockmgr_link import BlockManagerLink
from services.executor.core.config import EngineSettings, SchedulerConfig
from services.executor.core.engine import Engine
from services.executor.core.sequence import RequestKey
from services.executor.service.config import ExecutorConfig
from services.executor.service.startup import build_engine

from .conftest import CheckpointFactory
from .fake_runner import VOCAB, FakePagedRunner, reference_tokens
from .greedy import hf_greedy
from .windowed import (
    Workload,
    assert_pool_empty,
    run_across_a_blockmgr_restart,
    windowed_workload,
)

NAME, BS = "llama", 8


@pytest.fixture(scope="module")
def workload(hf_model: Callable[[str], PreTrainedModel]) -> Workload:
    """8 requests, prompts 20-60 tokens (half sharing a 24-token prefix), 24-48 new tokens."""
    return windowed_workload(hf_model(NAME), seed=11, num_requests=8, bos=1, max_tokens=(24, 48))


def _engine(
    tiny_checkpoint: CheckpointFactory,
    client: BlockManagerClient | None = None,
    *,
    mode: str = "swap",
    **kw,
) -> Engine:
    config = ExecutorConfig(
        model=str(tiny_checkpoint(kw.pop("name", NAME))),
        dtype="float32",
        device="cpu",
        block_size=BS,
        num_kv_blocks=kw.pop("num_kv_blocks", 33),  # 32 blocks: about 3 sequences at their end
        max_model_len=128,
        max_num_batched_tokens=kw.pop("max_num_batched_tokens", 64),
        kv_offloading_size=16 * 2**20 / 2**30,
        preemption_mode=mode,
        **kw,
    )
    engine, _ = build_engine(config, blockmgr=client or InProcessClient())
    return engine


def _run(engine: Engine, workload: Workload) -> dict[str, list[int]]:
    for i, (prompt, max_tokens, _) in enumerate(workload):
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
        engine.add_request(RequestKey(0, f"r{i}"), prompt, params)
    got: dict[str, list[int]] = {}
    while engine.has_work:
        for o in engine.step():
            got.setdefault(o.req_id.request_id, []).extend(o.token_ids)
    return got


def test_swapped_sequences_match_transformers_and_recompute_fewer_prompt_tokens(
    tiny_checkpoint, workload
) -> None:
    runs = {}
    for mode in ("swap", "recompute"):
        engine = _engine(tiny_checkpoint, mode=mode)
        got = _run(engine, workload)
        for i, (_, _, expected) in enumerate(workload):
            assert got[f"r{i}"] == expected, (mode, f"r{i}")
        assert engine.scheduler.num_preemptions > 0 and not engine.scheduler.swapped
        assert_pool_empty(engine)
        runs[mode] = engine
    swap, recompute = runs["swap"], runs["recompute"]
    assert (
        swap.scheduler.swapping.num_swapped_out > 0
        and recompute.scheduler.swapping.num_swapped_out == 0
    )
    # A sequence comes back only with room for its next chunk: no swap in and out each step.
    assert swap.scheduler.num_preemptions <= recompute.scheduler.num_preemptions
    stats = swap.link.client.stats(swap.link.pool_id)
    assert stats.num_swapped_out_blocks > 0 and stats.num_swapped_in_blocks > 0
    assert stats.num_swapped_sequences == 0
    # A swapped sequence keeps its computed tokens: it is never admitted again, where a
    # recomputed one is (its whole prompt and output looked up and computed past the hit).
    again = recompute.link.client.stats(recompute.link.pool_id)
    assert stats.prefix_cache_queries_tokens == sum(len(p) for p, _, _ in workload)
    assert again.prefix_cache_queries_tokens > stats.prefix_cache_queries_tokens
    assert swap.num_prompt_tokens <= recompute.num_prompt_tokens


def test_async_scheduling_with_swap_preemption_matches_transformers(
    tiny_checkpoint, workload
) -> None:
    engine = _engine(tiny_checkpoint, async_scheduling=True)
    got = _run(engine, workload)
    for i, (_, _, expected) in enumerate(workload):
        assert got[f"r{i}"] == expected, f"r{i}"
    assert engine.scheduler.swapping.num_swapped_out > 0
    assert_pool_empty(engine)


@pytest.mark.parametrize(
    ("name", "num_kv_blocks", "budget", "async_scheduling"),
    [
        ("gemma3", 29, 64, False),
        ("gemma3", 29, 64, True),
        ("gemma3", 25, 24, False),  # prompts in chunks past the window
    ],
)
def test_sliding_and_hybrid_models_swap_with_transformers_tokens(
    tiny_checkpoint, hf_model, name, num_kv_blocks, budget, async_scheduling
) -> None:
    """Gemma 3 (sliding groups around a full one), and Mistral's window: a sequence's
    entries released out of the window stay released through its swap, the others come back
    from their slots. A sequence whose grow would release blocks and that must preempt
    itself goes out with its tables as the pool holds them (no answer rejected)."""
    work = windowed_workload(hf_model(name), seed=3, num_requests=8, bos=2, max_tokens=(24, 48))
    engine = _engine(
        tiny_checkpoint,
        name=name,
        num_kv_blocks=num_kv_blocks,
        max_num_batched_tokens=budget,
        async_scheduling=async_scheduling,
    )
    got = _run(engine, work)
    for i, (_, _, expected) in enumerate(work):
        assert got[f"r{i}"] == expected, f"r{i}"
    assert engine.scheduler.swapping.num_swapped_out > 0 and engine.num_bad_answers == 0
    assert_pool_empty(engine)


@pytest.mark.parametrize(("name", "num_kv_blocks"), [("mistral_window", 8), ("gemma3", 25)])
def test_a_sequence_that_slides_and_preempts_itself_is_swapped_out_whole(
    tiny_checkpoint, hf_model, name: str, num_kv_blocks: int
) -> None:
    """Prompts in chunks past the window in a small cache: a sequence whose grow would
    release blocks out of the window, and that must preempt itself for room, is swapped out
    with its tables as the pool still holds them (the release goes with the grow it never
    got). No answer is rejected, and the tokens are transformers'."""
    hf, rng = hf_model(name), random.Random(0)
    work = []
    for _ in range(8):
        prompt = [2] + [rng.randrange(3, 600) for _ in range(rng.randrange(20, 60))]
        n = rng.randrange(24, 48)
        work.append((prompt, n, hf_greedy(hf, prompt, n)[0]))
    engine = _engine(
        tiny_checkpoint, name=name, num_kv_blocks=num_kv_blocks, max_num_batched_tokens=24
    )
    got = _run(engine, work)
    for i, (_, _, expected) in enumerate(work):
        assert got[f"r{i}"] == expected, f"r{i}"
    assert engine.scheduler.swapping.num_swapped_out > 0 and engine.num_bad_answers == 0
    assert_pool_empty(engine)


def test_an_aborted_swapped_out_sequence_gives_its_slots_back(tiny_checkpoint, workload) -> None:
    engine = _engine(tiny_checkpoint)
    for i, (prompt, max_tokens, _) in enumerate(workload):
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
        engine.add_request(RequestKey(0, f"r{i}"), prompt, params)
    while not engine.scheduler.swapped:
        engine.step()
    victim = engine.scheduler.swapped[0]
    assert engine.abort_request(victim.req_id)
    while engine.has_work:
        engine.step()
    stats = engine.link.client.stats(engine.link.pool_id)
    assert stats.num_swapped_sequences == 0 and engine.scheduler.swapping.slots_used == 0
    assert_pool_empty(engine)


def test_a_block_manager_restart_restores_swapped_out_sequences(tiny_checkpoint, workload):
    run_across_a_blockmgr_restart(
        lambda client: _engine(tiny_checkpoint, client),
        workload,
        lambda engine: bool(engine.scheduler.swapped),
    )


def test_swap_mode_needs_a_host_tier(tiny_checkpoint) -> None:
    with pytest.raises(ValueError, match="--kv-offloading-size"):
        ExecutorConfig(model=str(tiny_checkpoint(NAME)), preemption_mode="swap")
    with pytest.raises(ValueError, match="--preemption-mode"):
        ExecutorConfig(model=str(tiny_checkpoint(NAME)), preemption_mode="sometimes")


def _fake_engine(swap: bool, client: Any = None) -> Engine:
    """A model-free engine (its runner checks every context read back through the tables)
    over 24 blocks of 4 tokens, chunked prefill of 16 tokens, a host tier of 64 slots."""
    runner = FakePagedRunner(25, 4)
    spec = PoolSpec(25, 4, True, host_blocks=64)
    settings = EngineSettings(
        max_model_len=256,
        vocab_size=VOCAB,
        eos_token_ids=(2,),
        scheduler=SchedulerConfig(
            block_size=4,
            max_num_seqs=8,
            max_num_batched_tokens=16,
            watermark_blocks=0,
            swap_slots=64 if swap else 0,
        ),
    )
    return Engine(
        settings, runner, BlockManagerLink(client or InProcessClient(), "fake", spec, retry_s=0.001)
    )


def _run_fake(engine: Engine, prompts: list[list[int]]) -> None:
    """Every prompt at once, 24 tokens each: the fake model's reference tokens, each."""
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(RequestKey(0, f"r{i}"), prompt, params)
    got: dict[str, list[int]] = {}
    while engine.has_work:
        for o in engine.step():
            got.setdefault(o.req_id.request_id, []).extend(o.token_ids)
    for i, prompt in enumerate(prompts):
        assert got[f"r{i}"] == reference_tokens(prompt, 24), i


def test_a_sequence_swapped_back_in_makes_progress_before_it_is_swapped_out_again() -> None:
    rng = random.Random(5)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(rng.randrange(20, 60))] for _ in range(10)]
    runs = {}
    for swap in (True, False):
        engine = _fake_engine(swap)
        swapped_at: list[tuple[int, int]] = []  # (seq_id, computed tokens) at each swap-out
        swap_out = engine.scheduler._swap_out

        def counting(seq, plan, swap_out=swap_out, swapped_at=swapped_at):  # type: ignore[no-untyped-def]
            swapped_at.append((seq.seq_id, seq.num_computed_tokens))
            return swap_out(seq, plan)

        engine.scheduler._swap_out = counting  # type: ignore[method-assign]
        _run_fake(engine, prompts)
        runs[swap] = (engine.scheduler.num_preemptions, swapped_at)
    (swap_preemptions, swapped_at), (recompute_preemptions, _) = runs[True], runs[False]
    assert swapped_at and len(set(swapped_at)) == len(swapped_at)
    assert swap_preemptions <= recompute_preemptions


def test_swap_preemption_at_two_ranks_matches_transformers(tiny_checkpoint, workload) -> None:
    """Each rank swaps its shard of the blocks to its own host tier and back."""
    engine = _engine(tiny_checkpoint, tensor_parallel_size=2)
    try:
        got = _run(engine, workload)
    finally:
        engine.runner.close()
    for i, (_, _, expected) in enumerate(workload):
        assert got[f"r{i}"] == expected, f"r{i}"
    assert engine.scheduler.swapping.num_swapped_out > 0
    assert_pool_empty(engine)


class _LyingSwaps:
    """The real block manager, whose first swap-out answer says RESOURCE_EXHAUSTED (it went
    through) and whose first swap-in beside a grow's new block hands that block out again."""

    def __init__(self) -> None:
        self.inner = InProcessClient()
        self.lied: set[str] = set()

    def step(self, pool_id: str, epoch: int, ops: list) -> StepResult:
        result = self.inner.step(pool_id, epoch, ops)
        results = list(result.results)
        granted = [
            b for r in results if isinstance(r, GrowResult) for ids in r.new_block_ids for b in ids
        ]
        for i, r in enumerate(results):
            if isinstance(r, SwapOutResult) and "out" not in self.lied:
                self.lied.add("out")
                statuses = (OpStatus.RESOURCE_EXHAUSTED,) * len(r.statuses)
                results[i] = dataclasses.replace(r, statuses=statuses)
            elif (
                isinstance(r, SwapInResult) and granted and r.block_ids[0] and "in" not in self.lied
            ):
                self.lied.add("in")
                table = (granted[0], *r.block_ids[0][1:])
                results[i] = dataclasses.replace(r, block_ids=(table, *r.block_ids[1:]))
        return dataclasses.replace(result, results=tuple(results))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_lying_swap_answers_are_rejected_and_nothing_is_lost() -> None:
    client = _LyingSwaps()
    engine = _fake_engine(True, client)
    rng = random.Random(1)  # a workload that swaps in beside a grow's new block
    prompts = [[rng.randrange(3, VOCAB) for _ in range(rng.randrange(20, 60))] for _ in range(10)]
    _run_fake(engine, prompts)
    assert client.lied == {"out", "in"} and engine.num_bad_answers == 2
    assert engine.link.num_recoveries == 2
    c = client.inner.stats("fake").counters
    assert c.num_in_use_blocks == 0 and client.inner.stats("fake").num_swapped_sequences == 0
