"""A model with sliding-window and full-attention layers (Gemma 3: here one of each, window 16)
is served from a hybrid pool: one KV-cache group per kind, one block table per group, from one
set of blocks. Each grow gives back the sliding group's blocks out of the window while the full
group keeps every block, and the tokens still match transformers under prefix caching, chunked
prefill, preemption, n > 1 forks (copy-on-write in every group), async scheduling, CUDA-graph
replay (the eager stand-in) and a block-manager restart."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from transformers import PreTrainedModel

from pagedserve.kernels.ops import FORCE_TRITON_ENV
from services.blockmgr.api.protocol import BlockManagerClient
from services.blockmgr.api.types import AttentionKindName
from services.blockmgr.client import InProcessClient
from services.common.blocks import NULL_BLOCK, blocks_for_tokens, max_live_blocks
from services.common.sampling_params import SamplingParams
from services.executor.core.engine import Engine
from services.executor.core.sequence import RequestKey, Sequence
from services.executor.model.launch import build_runner
from services.executor.service.config import ExecutorConfig
from services.executor.service.startup import build_engine

from .conftest import CheckpointFactory
from .windowed import (
    Workload,
    assert_matches,
    assert_pool_empty,
    run_across_a_blockmgr_restart,
    run_checked,
    windowed_engine,
    windowed_workload,
)

NAME, WINDOW, BS = "gemma3", 16, 8
SLIDING, FULL = 0, 1  # the tiny Gemma 3: layer 0 slides, layer 1 attends to everything


@pytest.fixture(scope="module")
def workload(hf_model: Callable[[str], PreTrainedModel]) -> Workload:
    """8 requests, prompts 20-60 tokens (half sharing a 24-token prefix), 24-48 new tokens:
    sequences several windows long."""
    return windowed_workload(hf_model(NAME), seed=7, num_requests=8, bos=2, max_tokens=(24, 48))


def _engine(
    tiny_checkpoint: CheckpointFactory, client: BlockManagerClient | None = None, **kw
) -> Engine:
    kw.setdefault("num_kv_blocks", 80)
    return windowed_engine(tiny_checkpoint, NAME, BS, client, **kw)


def _run(engine: Engine, workload, *, n: int = 1) -> dict[str, list[list[int]]]:
    """Requests arrive a few per step; after every step, each decoding sequence holds at most
    the window's blocks in the sliding group and every block in the full group."""
    limit = max_live_blocks(WINDOW, BS)

    def check(seq: Sequence, decoding: bool) -> None:
        sliding, full = seq.tables
        assert len(sliding) == len(full)
        assert NULL_BLOCK not in full and not set(sliding) & set(full)
        if decoding:
            live = [b for b in sliding if b != NULL_BLOCK]
            assert len(live) <= limit, (seq.seq_id, seq.num_computed_tokens, live)

    return run_checked(engine, workload, check, n=n)


_assert_matches, _assert_pool_empty = assert_matches, assert_pool_empty


def test_the_pool_is_registered_with_a_sliding_and_a_full_group(tiny_checkpoint) -> None:
    engine = _engine(tiny_checkpoint)
    kinds = [(g.kind, g.sliding_window, g.layers) for g in engine.link.pool.groups]
    assert kinds == [(AttentionKindName.SLIDING, WINDOW, (0,)), (AttentionKindName.FULL, 0, (1,))]
    assert engine.scheduler.config.group_slides == (True, False)
    assert engine.runner.kv_cache.shape[0] == 1  # one layer per group: one slot


@pytest.mark.parametrize(
    "name",
    ["default", "tiny_kv_cache", "async_chunks_longer_than_the_window"],
)
def test_hybrid_pool_matches_transformers_and_slides_only_the_sliding_group(
    tiny_checkpoint, workload, name
) -> None:
    kw = {
        "default": {},
        "tiny_kv_cache": {"num_kv_blocks": 26},  # 25 blocks: sequences are preempted
        "async_chunks_longer_than_the_window": {
            "async_scheduling": True,
            "max_num_batched_tokens": 48,
        },
    }[name]
    engine = _engine(tiny_checkpoint, **kw)
    _assert_matches(_run(engine, workload), workload)
    stats = engine.link.client.stats(engine.link.pool_id)
    if name == "default":
        assert stats.prefix_cache_hits_tokens > 0
    if name == "tiny_kv_cache":
        assert engine.scheduler.num_preemptions > 0
    if name.startswith("async"):
        assert engine.num_steps_ahead > 0 and engine.num_bad_answers == 0
    _assert_pool_empty(engine)


def test_n_greater_than_one_forks_copy_on_write_in_every_group(tiny_checkpoint, workload) -> None:
    engine = _engine(tiny_checkpoint)
    _assert_matches(_run(engine, workload[:4], n=3), workload[:4])
    assert engine.link.client.stats(engine.link.pool_id).num_cow_copies > 0
    _assert_pool_empty(engine)


def test_the_decode_graphs_replay_hybrid_tables(tiny_checkpoint, workload) -> None:
    """The graph path (its eager stand-in on the CPU) reads every group's table from the
    persistent buffers, as the eager forward does."""
    config = ExecutorConfig(
        model=str(tiny_checkpoint(NAME)),
        dtype="float32",
        device="cpu",
        block_size=BS,
        num_kv_blocks=80,
        max_model_len=128,
        max_num_batched_tokens=32,
        cuda_graph_sizes=(1, 2, 4, 8),
    )
    runner = build_runner(config.runner_config(), graph_backend="eager")
    engine, _ = build_engine(config, runner=runner, blockmgr=InProcessClient())
    _assert_matches(_run(engine, workload), workload)
    assert runner.graphs is not None and runner.graphs.num_replays > 0


def test_a_long_sequence_holds_its_window_in_the_sliding_group(tiny_checkpoint) -> None:
    """200 tokens in a window of 16 (block size 8): the blocks in use never pass the full
    group's blocks plus the sliding group's 3."""
    engine = _engine(tiny_checkpoint, max_model_len=220, num_kv_blocks=40)
    engine.add_request(
        RequestKey(0, "long"),
        [2, 5, 9, 13],
        SamplingParams(temperature=0.0, max_tokens=196, ignore_eos=True),
    )
    while engine.has_work:
        engine.step()
        in_use = engine.link.client.stats(engine.link.pool_id).counters.num_in_use_blocks
        for seq in engine.scheduler.running:
            full = blocks_for_tokens(seq.num_computed_tokens + 1, BS)
            assert in_use <= full + max_live_blocks(WINDOW, BS)
    _assert_pool_empty(engine)


def test_a_block_manager_restart_restores_every_groups_tables(tiny_checkpoint, workload) -> None:
    run_across_a_blockmgr_restart(
        lambda client: _engine(tiny_checkpoint, client),
        workload,
        lambda engine: any(NULL_BLOCK in s.tables[SLIDING] for s in engine.scheduler.running),
    )


def test_the_triton_kernels_read_each_groups_tables(tiny_checkpoint, workload, monkeypatch):
    """The CUDA path's kernels (under the Triton interpreter) through a hybrid pool: each
    layer's calls get its group's tables and slots."""
    monkeypatch.setenv(FORCE_TRITON_ENV, "1")
    engine = _engine(tiny_checkpoint)
    few = [(prompt, 3, expected[:3]) for prompt, _, expected in workload[:1]]
    _assert_matches(_run(engine, few), few)
    _assert_pool_empty(engine)
