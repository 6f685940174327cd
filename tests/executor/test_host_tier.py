"""The block manager's host tier through a real engine: a KV cache too small for a
conversation's history offloads evicted blocks into host memory and onboards them on the next
turn's prefix hit, and the tokens stay transformers' (sync and async scheduling)."""

from __future__ import annotations

import random

import pytest

from services.blockmgr.client import InProcessClient
from services.common.sampling_params import SamplingParams
from services.executor.core.sequence import RequestKey
from services.executor.model.errors import ModelLoadError
from services.executor.model.launch import build_runner
from services.executor.service.config import ExecutorConfig
from services.executor.service.startup import build_engine

from .greedy import hf_greedy


def _config(tiny_checkpoint, name: str = "llama", **kw) -> ExecutorConfig:
    kw.setdefault("num_kv_blocks", 14)  # 13 blocks of 8: two conversations do not fit
    return ExecutorConfig(
        model=str(tiny_checkpoint(name)),
        dtype="float32",
        device="cpu",
        block_size=8,
        max_model_len=104,
        max_num_batched_tokens=32,
        kv_offloading_size=64 * 2**20 / 2**30,  # 64 MiB: every block ever evicted
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
    rng = random.Random(3)
    histories = [[1] + [rng.randrange(3, 600) for _ in range(30)] for _ in range(3)]
    for turn in range(3):  # the conversations take turns: each evicts the others' blocks
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
            assert got == hf_greedy(hf_model("llama"), history, 4)[0], (c, turn)
            history.extend(got)
    stats = engine.link.client.stats(engine.link.spec.pool_id)
    assert stats.pool.host_blocks > 0 and stats.num_offloaded_blocks > 0
    assert stats.num_onboarded_blocks > 0 and stats.host_hits_tokens > 0


def test_a_host_tier_is_refused_for_a_model_whose_layers_slide(tiny_checkpoint) -> None:
    config = _config(tiny_checkpoint, "mistral_window", num_kv_blocks=40)
    with pytest.raises(ModelLoadError, match="--kv-offloading-size"):
        build_runner(config.runner_config())
