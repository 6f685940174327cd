"""A model whose every layer slides (Mistral-style, window 16) is served from a sliding-window
pool: each grow gives back the blocks out of the window, so a decoding sequence holds at most
``ceil(W / block_size) + 1`` blocks, and the tokens still match transformers under prefix
caching, chunked prefill, preemption, n > 1 forks, async scheduling and a block-manager
restart."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
from transformers import PreTrainedModel

from services.blockmgr.api.protocol import BlockManagerClient
from services.blockmgr.api.types import (
    Admit,
    AttentionKindName,
    Free,
    GrowResult,
    OpStatus,
    StepResult,
)
from services.blockmgr.client import InProcessClient
from services.common.blocks import NULL_BLOCK, max_live_blocks
from services.common.sampling_params import SamplingParams
from services.executor.core.engine import Engine
from services.executor.core.plan import BadAnswer, SchedulePlan, check_answer
from services.executor.core.sequence import RequestKey, Sequence

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

NAME, WINDOW, BS = "mistral_window", 16, 8


@pytest.fixture(scope="module")
def workload(hf_model: Callable[[str], PreTrainedModel]) -> Workload:
    """12 requests, prompts 20-60 tokens (half sharing a 24-token prefix), 30-60 new tokens:
    sequences several windows long."""
    return windowed_workload(hf_model(NAME), seed=5, num_requests=12, bos=1, max_tokens=(30, 60))


def _engine(
    tiny_checkpoint: CheckpointFactory, client: BlockManagerClient | None = None, **kw
) -> Engine:
    kw.setdefault("num_kv_blocks", 40)
    return windowed_engine(tiny_checkpoint, NAME, BS, client, **kw)


def _run(engine: Engine, workload, *, n: int = 1, per_step: int = 3) -> dict[str, list[list[int]]]:
    """Requests arrive a few per step; after every step, each decoding sequence holds at most
    the window's blocks."""
    limit = max_live_blocks(WINDOW, BS)

    def check(seq: Sequence, decoding: bool) -> None:
        if decoding:
            live = [b for b in seq.block_table if b != NULL_BLOCK]
            assert len(live) <= limit, (seq.seq_id, seq.num_computed_tokens, live)

    return run_checked(engine, workload, check, n=n, per_step=per_step)


_assert_matches, _assert_pool_empty = assert_matches, assert_pool_empty


def test_the_pool_is_registered_as_one_sliding_group(tiny_checkpoint) -> None:
    engine = _engine(tiny_checkpoint)
    (group,) = engine.link.pool.groups
    assert (group.kind, group.sliding_window) == (AttentionKindName.SLIDING, WINDOW)
    assert engine.scheduler.config.sliding_window == WINDOW


@pytest.mark.parametrize(
    "name",
    [
        "default",
        "async_scheduling",
        "tiny_kv_cache",
        "async_tiny_kv_cache",
        "no_prefix_caching",
        "chunks_longer_than_the_window",
    ],
)
def test_sliding_pool_matches_transformers_and_holds_only_the_window(
    tiny_checkpoint, workload, name
) -> None:
    kw = {
        "default": {},
        "async_scheduling": {"async_scheduling": True},
        "tiny_kv_cache": {"num_kv_blocks": 9},  # 8 blocks: sequences are preempted
        "async_tiny_kv_cache": {"async_scheduling": True, "num_kv_blocks": 9},
        "no_prefix_caching": {"enable_prefix_caching": False},
        # Async scheduling plans a step ahead while the current one, whose prefill chunks
        # span more than the window, has yet to read its tables.
        "chunks_longer_than_the_window": {"async_scheduling": True, "max_num_batched_tokens": 48},
    }[name]
    engine = _engine(tiny_checkpoint, **kw)
    _assert_matches(_run(engine, workload), workload)
    stats = engine.link.client.stats(engine.link.pool_id)
    if name == "default":
        assert stats.prefix_cache_hits_tokens > 0
    if name.endswith("tiny_kv_cache"):
        assert engine.scheduler.num_preemptions > 0
    if name.startswith("async") or name.startswith("chunks"):
        assert engine.num_steps_ahead > 0 and engine.num_bad_answers == 0
    _assert_pool_empty(engine)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_n_greater_than_one_forks_share_the_window_blocks(
    tiny_checkpoint, workload, async_scheduling
) -> None:
    engine = _engine(tiny_checkpoint, async_scheduling=async_scheduling)
    _assert_matches(_run(engine, workload[:6], n=3), workload[:6])
    assert engine.link.client.stats(engine.link.pool_id).num_cow_copies > 0
    _assert_pool_empty(engine)


def test_a_sequence_many_windows_long_holds_at_most_the_window_blocks(tiny_checkpoint) -> None:
    """400 tokens in a window of 16 (block size 8): never more than 3 blocks while decoding;
    the pool's blocks in use stay as small."""
    engine = _engine(tiny_checkpoint, max_model_len=420, num_kv_blocks=12)
    engine.add_request(
        RequestKey(0, "long"),
        [1, 5, 9, 13],
        SamplingParams(temperature=0.0, max_tokens=396, ignore_eos=True),
    )
    most = 0
    while engine.has_work:
        engine.step()
        in_use = engine.link.client.stats(engine.link.pool_id).counters.num_in_use_blocks
        most = max(most, in_use)
    assert most <= max_live_blocks(WINDOW, BS)
    _assert_pool_empty(engine)


def test_a_block_manager_restart_restores_tables_with_released_blocks(
    tiny_checkpoint, workload
) -> None:
    run_across_a_blockmgr_restart(
        lambda client: _engine(tiny_checkpoint, client),
        workload,
        lambda engine: any(NULL_BLOCK in s.block_table for s in engine.scheduler.running),
    )


class HogsThePool:
    """A client that, before each of Steps ``at`` .. ``at + 3``, fills the pool's free blocks
    with sequences of its own (so the executor's grows that need a block are refused), and
    frees them before the next: a block manager whose capacity changed under the executor."""

    HOG = 2**40

    def __init__(self, inner: InProcessClient, at: int) -> None:
        self.inner, self.at, self.calls = inner, at, 0
        self.hogs: list[int] = []

    def step(self, pool_id: str, epoch: int, ops: list) -> StepResult:
        self._hog(pool_id, epoch)
        return self.inner.step(pool_id, epoch, ops)

    def step_async(self, pool_id: str, epoch: int, ops: list) -> Any:
        self._hog(pool_id, epoch)
        return self.inner.step_async(pool_id, epoch, ops)

    def _hog(self, pool_id: str, epoch: int) -> None:
        self.calls += 1
        if self.at <= self.calls < self.at + 4:
            free = self.inner.stats(pool_id).counters.num_free_blocks
            if free:
                self.hogs.append(self.HOG + self.calls)
                tokens = free * BS
                self.inner.step(pool_id, epoch, [Admit(self.hogs[-1], tokens, tokens)])
        elif self.hogs:
            self.inner.step(pool_id, epoch, [Free(tuple(self.hogs))])
            self.hogs = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_grow_the_pool_refuses_requeues_its_sequence_without_a_bad_answer(
    tiny_checkpoint, workload, async_scheduling
) -> None:
    """The pool releases nothing for a refused grow, while the executor's mirror had slid
    it: the sequence is requeued (its Free reconciles both), never taken for a bad answer."""
    client = HogsThePool(InProcessClient(), at=3)
    engine = _engine(tiny_checkpoint, client, async_scheduling=async_scheduling)
    _assert_matches(_run(engine, workload[:8]), workload[:8])
    assert engine.num_bad_answers == 0 and engine.link.num_recoveries == 0
    _assert_pool_empty(engine)


def test_a_refused_grow_reports_the_first_live_block_it_had_and_that_is_no_bad_answer() -> None:
    """The mirror slid the sequence when it planned the grow; the pool refused the grow and
    released nothing, so it reports the old first live block: the check accepts it (the
    sequence is requeued), while a granted grow must report exactly the mirror's."""
    seq = Sequence(1, RequestKey(0, "r"), 0, list(range(40)), 40, SamplingParams(), 0, 0)
    seq.block_table, seq.num_computed_tokens, seq.first_live_block = [0, 0, 5, 6, 7], 40, 2
    plan = SchedulePlan(grows=[(seq, 1)], grow_blocks=[1], grow_first_live=[2])
    kw = {"block_size": BS, "num_blocks": 64, "refs": Counter({5: 1, 6: 1, 7: 1})}
    refused = GrowResult((OpStatus.RESOURCE_EXHAUSTED,), ((),), (), (1,))
    check_answer(plan, refused, [], sliding_window=WINDOW, **kw)
    granted_wrong = GrowResult((OpStatus.OK,), ((9,),), (), (1,))
    with pytest.raises(BadAnswer):
        check_answer(plan, granted_wrong, [], sliding_window=WINDOW, **kw)
    check_answer(
        plan, GrowResult((OpStatus.OK,), ((9,),), (), (2,)), [], sliding_window=WINDOW, **kw
    )
