"""The block manager's host tier through a real engine: a KV cache too small for a
conversation's history offloads evicted blocks into host memory and onboards them on the next
turn's prefix hit, and the tokens stay transformers' (sync and async scheduling)."""

from __future__ import annotations

import json
import random

import pytest
import torch

from services.blockmgr.client import InProcessClient
from services.common.sampling_params import SamplingParams
from services.executor.core.sequence import FinishReason, RequestKey
from services.executor.model.config import ModelConfig
from services.executor.model.kv_cache import bytes_per_block
from services.executor.model.launch import build_runner
from services.executor.service.config import ExecutorConfig
from services.executor.service.startup import build_engine

from .greedy import hf_greedy


def _config(tiny_checkpoint, name: str = "llama", **kw) -> ExecutorConfig:
    kw.setdefault("num_kv_blocks", 14)  # 13 blocks of 8: two conversations do not fit
    kw.setdefault("kv_offloading_size", 64 * 2**20 / 2**30)  # 64 MiB: every block evicted
    kw.setdefault("device", "cpu")
    kw.setdefault("max_model_len", 104)
    kw.setdefault("max_num_batched_tokens", 32)
    return ExecutorConfig(model=str(tiny_checkpoint(name)), dtype="float32", block_size=8, **kw)


@pytest.mark.parametrize("fills_async", [False, True])
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_conversation_evicted_to_the_host_tier_comes_back_on_its_next_turn(
    tiny_checkpoint, hf_model, async_scheduling, fills_async
) -> None:
    """In line, and with the fills on the runner's worker thread (the CUDA default), the
    sequences that read their blocks held back a step."""
    config = _config(tiny_checkpoint, async_scheduling=async_scheduling)
    engine = _engine(config, fills_async)
    try:
        _converse(engine, hf_model("llama"), seed=3)
    finally:
        engine.runner.close()
    stats = engine.link.client.stats(engine.link.pool_id)
    assert stats.pool.host_blocks > 0 and stats.num_offloaded_blocks > 0
    assert stats.num_onboarded_blocks > 0 and stats.host_hits_tokens > 0
    assert (engine.scheduler.num_chunks_held_back > 0) == fills_async
    _assert_moves_counted_as_ordered(engine, stats)


@pytest.mark.parametrize("policy", ["s3fifo", "reuse"])
def test_a_conversation_comes_back_from_the_host_tier_under_a_learnt_policy(
    tiny_checkpoint, hf_model, policy
) -> None:
    """The device pool and the host tier both ordered by ``policy``: evicted histories still
    come back on their next turns, with transformers' tokens."""
    config = _config(tiny_checkpoint, eviction_policy=policy, kv_offloading_eviction_policy=policy)
    engine = _engine(config, fills_async=False)
    try:
        _converse(engine, hf_model("llama"), seed=6)
    finally:
        engine.runner.close()
    stats = engine.link.client.stats(engine.link.pool_id)
    assert stats.pool.eviction_policy.value == policy == stats.pool.tier_eviction_policy.value
    assert stats.num_offloaded_blocks > 0 and stats.host_hits_tokens > 0


def test_a_sequence_waits_for_its_fill_while_the_rest_of_the_batch_runs(
    tiny_checkpoint, hf_model, tmp_path
) -> None:
    """Fills beside the forward: in the step whose Step onboards (and loads from disk) a
    returning conversation's history, that conversation is held back and the one decoding
    beside it still gets its token; both answers are transformers'. The fills are waited
    for before the next step, whose batch runs the held-back chunk."""
    per_block = _block_bytes(tiny_checkpoint)
    config = _config(
        tiny_checkpoint,
        num_kv_blocks=24,
        kv_offloading_size=3 * per_block / 2**30,  # most of the history goes on to disk
        kv_offloading_disk_path=str(tmp_path / "tier"),
        kv_offloading_disk_size=64 * per_block / 2**30,
    )
    engine = _engine(config, fills_async=True)
    hf, rng = hf_model("llama"), random.Random(8)

    def params(max_tokens: int) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=max_tokens)

    history = [1] + [rng.randrange(3, 600) for _ in range(40)]
    others = [[1] + [rng.randrange(3, 600) for _ in range(60)] for _ in range(3)]
    try:
        for i, prompt in enumerate([history, *others]):  # the others evict the history
            engine.add_request(RequestKey(0, f"p{i}"), prompt, params(2))
            while engine.has_work:
                engine.step()
        beside = [1] + [rng.randrange(3, 600) for _ in range(20)]
        engine.add_request(RequestKey(0, "beside"), beside, params(12))
        got: dict[str, list[int]] = {"beside": [], "back": []}
        for o in engine.step():  # its prefill: it decodes from now on
            got["beside"].extend(o.token_ids)
        history += [rng.randrange(3, 600) for _ in range(5)]
        engine.add_request(RequestKey(0, "back"), list(history), params(4))
        held_in: list[set[str]] = []  # per step where a chunk was held back: who got tokens
        while engine.has_work:
            before = engine.scheduler.num_chunks_held_back
            outputs = engine.step()
            for o in outputs:
                got[o.req_id.request_id].extend(o.token_ids)
            if engine.scheduler.num_chunks_held_back > before:
                held_in.append({o.req_id.request_id for o in outputs if o.token_ids})
    finally:
        engine.runner.close()
    stats = engine.link.client.stats(engine.link.pool_id)
    assert stats.num_onboarded_blocks > 0 and stats.num_loaded_blocks > 0
    assert held_in and all(who == {"beside"} for who in held_in)
    assert got["back"] == hf_greedy(hf, history, 4)[0]
    assert got["beside"] == hf_greedy(hf, beside, 12)[0]


@pytest.mark.parametrize(("name", "num_kv_blocks"), [("mistral_window", 10), ("gemma3", 24)])
def test_sliding_and_hybrid_models_onboard_from_the_host_tier_with_transformers_tokens(
    tiny_checkpoint, hf_model, name: str, num_kv_blocks: int
) -> None:
    """A sliding-window model (one sliding group) and a Gemma 3 one (sliding groups around
    a full one): every group's evicted blocks come back from the tier."""
    engine, _ = build_engine(
        _config(tiny_checkpoint, name, num_kv_blocks=num_kv_blocks), blockmgr=InProcessClient()
    )
    _converse(engine, hf_model(name), seed=5)
    stats = engine.link.client.stats(engine.link.pool_id)
    assert stats.num_offloaded_blocks > 0 and stats.host_hits_tokens > 0


@pytest.mark.parametrize("tensor_parallel_size", [1, 2])
def test_host_blocks_spill_to_a_disk_tier_and_load_back_with_transformers_tokens(
    tiny_checkpoint, hf_model, tmp_path, tensor_parallel_size
) -> None:
    """A host tier of 6 blocks over a disk tier, both ARC: a conversation's history, evicted
    from the device and then from the host, comes back from the disk on its next turn; at
    2 ranks, each moves its shard of the blocks between its own tiers."""
    # A rank holds its share of every block: these sizes are per rank.
    per_block = _block_bytes(tiny_checkpoint) / tensor_parallel_size
    config = _config(
        tiny_checkpoint,
        kv_offloading_size=6 * per_block / 2**30,
        kv_offloading_disk_path=str(tmp_path / "tier"),
        kv_offloading_disk_size=256 * per_block / 2**30,
        kv_offloading_eviction_policy="arc",
        tensor_parallel_size=tensor_parallel_size,
    )
    engine, _ = build_engine(config, blockmgr=InProcessClient())
    try:
        _converse(engine, hf_model("llama"), seed=4)
    finally:
        engine.runner.close()
    stats = engine.link.client.stats(engine.link.pool_id)
    assert (stats.pool.host_blocks, stats.pool.disk_blocks) == (6, 256)
    assert stats.pool.tier_eviction_policy.value == "arc"
    assert stats.num_spilled_blocks > 0 and stats.num_loaded_blocks > 0
    assert stats.disk_hits_tokens > 0
    assert not list((tmp_path / "tier").iterdir())  # mapped, then unlinked: never left behind
    _assert_moves_counted_as_ordered(engine, stats)


def _block_bytes(tiny_checkpoint, name: str = "llama") -> float:
    """The bytes of one KV block (of 8 tokens, fp32) of the tiny ``name`` model."""
    model = tiny_checkpoint(name)
    mc = ModelConfig.from_hf_config(json.loads((model / "config.json").read_text()))
    return bytes_per_block(mc, 8, torch.float32)


def _assert_moves_counted_as_ordered(engine, stats) -> None:
    """The engine's move counters (the executor's load report, the gateway's
    ``pagedserve_kv_tier_blocks_moved_total``) are the block manager's own counts."""
    moved = engine.num_blocks_moved
    assert moved["offload"] == stats.num_offloaded_blocks > 0
    assert moved["onboard"] == stats.num_onboarded_blocks > 0
    assert moved["spill"] + moved["store"] == stats.num_spilled_blocks
    assert moved["load"] == stats.num_loaded_blocks
    assert engine.num_failed_moves == 0


def _assert_pool_empty(engine) -> None:
    c = engine.link.client.stats(engine.link.pool_id).counters
    assert c.num_in_use_blocks == 0 and c.num_free_blocks == c.num_usable_blocks


def _engine(config: ExecutorConfig, fills_async: bool):
    """An engine whose runner fills blocks beside the forward or in line (``fills_async``;
    the default is beside on CUDA, in line on the CPU, where the copies take the cores the
    forward computes on)."""
    runner = build_runner(config.runner_config())
    runner.fills_async = fills_async  # read by the engine when it is built
    engine, _ = build_engine(config, runner=runner, blockmgr=InProcessClient())
    return engine


def _converse(engine, hf, *, seed: int) -> list[list[int]]:
    """3 conversations taking 3 turns each, one request at a time (each evicts the others'
    blocks); every answer is transformers' (``hf``; None: not checked). Returns them."""
    answers: list[list[int]] = []
    rng = random.Random(seed)
    histories = [[1] + [rng.randrange(3, 600) for _ in range(30)] for _ in range(3)]
    for turn in range(3):
        for c, history in enumerate(histories):
            history.extend(rng.randrange(3, 600) for _ in range(6))
            engine.add_request(
                RequestKey(0, f"c{c}t{turn}"),
                list(history),
                SamplingParams(temperature=0.0, max_tokens=4),
            )
            got: list[int] = []
            while engine.has_work:
                for o in engine.step():
                    got.extend(o.token_ids)
            if hf is not None:
                assert got == hf_greedy(hf, history, 4)[0], (c, turn)
            history.extend(got)
            answers.append(got)
    return answers


def test_a_disk_tier_needs_a_host_tier_and_a_path(tiny_checkpoint) -> None:
    with pytest.raises(ValueError, match="--kv-offloading-size"):
        ExecutorConfig(model="m", kv_offloading_disk_path="/tmp/x", kv_offloading_disk_size=1)
    with pytest.raises(ValueError, match="--kv-offloading-disk-path"):
        ExecutorConfig(model="m", kv_offloading_size=1, kv_offloading_disk_size=1)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_held_back_chunks_keep_samples_and_logprobs_exact_and_free_their_blocks(
    tiny_checkpoint, async_scheduling
) -> None:
    """Returning conversations whose histories come back from the host tier, at once: a
    seeded n = 2 request, one asking for log-probabilities, one aborted while its chunk is
    held back, beside a decode. With the fills beside the forward, every output (tokens,
    log-probabilities, ends) is what the fills in line give, and the pool ends empty."""
    results = []
    abort_at: int | None = None  # the step back2 is aborted after (the same in both runs)
    for fills_async in (True, False):
        config = _config(tiny_checkpoint, num_kv_blocks=32, async_scheduling=async_scheduling)
        engine = _engine(config, fills_async)
        rng = random.Random(2)
        histories = [[1] + [rng.randrange(3, 600) for _ in range(44)] for _ in range(8)]
        greedy = SamplingParams(temperature=0.0, max_tokens=2)
        for c, history in enumerate(histories):  # each evicts the ones before
            engine.add_request(RequestKey(0, f"first{c}"), history, greedy)
            while engine.has_work:
                engine.step()
        kinds = [
            SamplingParams(temperature=0.8, seed=11, n=2, max_tokens=6),
            SamplingParams(temperature=0.0, max_tokens=5, logprobs=2),
            SamplingParams(temperature=0.0, max_tokens=5),
        ]
        beside = SamplingParams(temperature=0.0, max_tokens=9)
        engine.add_request(RequestKey(0, "beside"), [1, 5, 6, 7], beside)
        got: dict[tuple[str, int], list] = {}
        for c, params in enumerate(kinds):
            engine.add_request(RequestKey(0, f"back{c}"), histories[c] + [9, 10, 11], params)
        try:
            step = 0
            while engine.has_work:
                for o in engine.step():
                    key = (o.req_id.request_id, o.index)
                    got.setdefault(key, []).append(
                        (o.token_ids, o.logprobs, o.prompt_logprobs, o.finish_reason)
                    )
                step += 1
                # (async scheduling: the batch granted ahead may already carry the chunk)
                ahead = engine._batch_ahead.chunks if engine._batch_ahead else []
                waits = [s for s, _ in engine.scheduler.held_back.granted] + [c.seq for c in ahead]
                unrun = ("back2", 0) not in got and any(
                    s.req_id.request_id == "back2" for s in waits
                )
                if step == abort_at or (abort_at is None and unrun):
                    assert engine.abort_request(RequestKey(0, "back2"))
                    abort_at = step
        finally:
            engine.runner.close()
        _assert_pool_empty(engine)
        # Every returning conversation came back from the tier: held back, with the fills
        # beside the forward.
        assert engine.scheduler.num_chunks_held_back == (3 if fills_async else 0)
        if fills_async:  # aborted while held back: no token, its slots freed
            assert got.pop(("back2", 0)) == [([], (), (), FinishReason.ABORT)]
        else:  # (in line, it ran in the step it was admitted)
            got.pop(("back2", 0))
        results.append(got)
    assert results[0] == results[1]


def test_fills_run_beside_the_forward_by_default_on_cuda_only(tiny_checkpoint) -> None:
    """The default: in line on the CPU (the copies would take the forward's cores)."""
    engine, _ = build_engine(_config(tiny_checkpoint), blockmgr=InProcessClient())
    assert not engine.runner.fills_async  # type: ignore[attr-defined]
    assert not engine.scheduler.config.defer_filled_chunks


# ---- on a GPU -------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_cuda_fills_on_their_stream_give_the_tokens_of_fills_in_line(
    tiny_checkpoint, tmp_path, async_scheduling
) -> None:
    """On CUDA the fills run on the host tier's copy stream by default (pinned host slots,
    a disk tier below), the sequences that read the filled blocks held back a step: the
    answers are those of the same engine with its fills in line."""
    per_block = _block_bytes(tiny_checkpoint)
    answers = []
    for fills_async in (True, False):
        config = _config(
            tiny_checkpoint,
            device="cuda",
            async_scheduling=async_scheduling,
            kv_offloading_size=6 * per_block / 2**30,
            kv_offloading_disk_path=str(tmp_path / f"tier-{fills_async}"),
            kv_offloading_disk_size=256 * per_block / 2**30,
        )
        engine = _engine(config, fills_async)
        try:
            answers.append(_converse(engine, None, seed=6))
        finally:
            engine.runner.close()
        stats = engine.link.client.stats(engine.link.pool_id)
        assert stats.num_onboarded_blocks > 0 and stats.num_loaded_blocks > 0
        assert (engine.scheduler.num_chunks_held_back > 0) == fills_async
    assert answers[0] == answers[1]


@pytest.mark.parametrize(
    ("kv_dtype", "stored", "scaled"), [("fp8", "float8_e4m3fn", True), ("int8", "int8", False)]
)
def test_a_quantized_cache_moves_to_the_host_tier_and_back_as_raw_bytes(
    tiny_checkpoint, kv_dtype: str, stored: str, scaled: bool
) -> None:
    """``--kv-cache-dtype fp8`` / ``int8`` with a host tier: the conversations' blocks go to
    the host and come back byte for byte (int8: each record with its scale): the answers are
    those of the same cache without a tier (which computes the evicted history again), and
    the pool records the cache's dtype (and an fp8 cache's scales)."""
    answers = []
    for size in (64 * 2**20 / 2**30, 0.0):
        config = _config(tiny_checkpoint, kv_cache_dtype=kv_dtype, kv_offloading_size=size)
        engine = _engine(config, fills_async=False)
        try:
            answers.append(_converse(engine, None, seed=3))
        finally:
            engine.runner.close()
        stats = engine.link.client.stats(engine.link.pool_id)
        assert stats.pool.kv_cache_dtype == stored and bool(stats.pool.kv_scales) == scaled
        if size:
            assert stats.num_onboarded_blocks > 0 and stats.host_hits_tokens > 0
    assert answers[0] == answers[1]
