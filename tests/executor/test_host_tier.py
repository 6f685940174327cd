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
from services.executor.core.sequence import RequestKey
from services.executor.model.config import ModelConfig
from services.executor.model.errors import ModelLoadError
from services.executor.model.kv_cache import bytes_per_block
from services.executor.service.config import ExecutorConfig
from services.executor.service.startup import build_engine

from .greedy import hf_greedy


def _config(tiny_checkpoint, name: str = "llama", **kw) -> ExecutorConfig:
    kw.setdefault("num_kv_blocks", 14)  # 13 blocks of 8: two conversations do not fit
    kw.setdefault("kv_offloading_size", 64 * 2**20 / 2**30)  # 64 MiB: every block evicted
    return ExecutorConfig(
        model=str(tiny_checkpoint(name)),
        dtype="float32",
        device="cpu",
        block_size=8,
        max_model_len=104,
        max_num_batched_tokens=32,
        **kw,
    )


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_conversation_evicted_to_the_host_tier_comes_back_on_its_next_turn(
    tiny_checkpoint, hf_model, async_scheduling
) -> None:
    engine, _ = build_engine(
        _config(tiny_checkpoint, async_scheduling=async_scheduling),
        blockmgr=InProcessClient(),
    )
    _converse(engine, hf_model("llama"), seed=3)
    stats = engine.link.client.stats(engine.link.spec.pool_id)
    assert stats.pool.host_blocks > 0 and stats.num_offloaded_blocks > 0
    assert stats.num_onboarded_blocks > 0 and stats.host_hits_tokens > 0


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
    stats = engine.link.client.stats(engine.link.spec.pool_id)
    assert stats.num_offloaded_blocks > 0 and stats.host_hits_tokens > 0


def test_swap_preemption_is_refused_for_a_hybrid_model(tiny_checkpoint) -> None:
    config = _config(tiny_checkpoint, "gemma3", num_kv_blocks=24, preemption_mode="swap")
    with pytest.raises(ModelLoadError, match="--preemption-mode swap"):
        build_engine(config, blockmgr=InProcessClient())


@pytest.mark.parametrize("tensor_parallel_size", [1, 2])
def test_host_blocks_spill_to_a_disk_tier_and_load_back_with_transformers_tokens(
    tiny_checkpoint, hf_model, tmp_path, tensor_parallel_size
) -> None:
    """A host tier of 6 blocks over a disk tier, both ARC: a conversation's history, evicted
    from the device and then from the host, comes back from the disk on its next turn; at
    2 ranks, each moves its shard of the blocks between its own tiers."""
    model = tiny_checkpoint("llama")
    mc = ModelConfig.from_hf_config(json.loads((model / "config.json").read_text()))
    # A rank holds its share of every block: these sizes are per rank.
    per_block = bytes_per_block(mc, 8, torch.float32) / tensor_parallel_size
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
    stats = engine.link.client.stats(engine.link.spec.pool_id)
    assert (stats.pool.host_blocks, stats.pool.disk_blocks) == (6, 256)
    assert stats.pool.tier_eviction_policy.value == "arc"
    assert stats.num_spilled_blocks > 0 and stats.num_loaded_blocks > 0
    assert stats.disk_hits_tokens > 0
    assert not list((tmp_path / "tier").iterdir())  # mapped, then unlinked: never left behind


def _converse(engine, hf, *, seed: int) -> None:
    """3 conversations taking 3 turns each, one request at a time (each evicts the others'
    blocks); every answer is transformers'."""
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
            assert got == hf_greedy(hf, history, 4)[0], (c, turn)
            history.extend(got)


def test_a_disk_tier_needs_a_host_tier_and_a_path(tiny_checkpoint) -> None:
    with pytest.raises(ValueError, match="--kv-offloading-size"):
        ExecutorConfig(model="m", kv_offloading_disk_path="/tmp/x", kv_offloading_disk_size=1)
    with pytest.raises(ValueError, match="--kv-offloading-disk-path"):
        ExecutorConfig(model="m", kv_offloading_size=1, kv_offloading_disk_size=1)
