"""Swap preemption in sliding-window and hybrid pools, at the scheduler against the real
(in-process) block manager, over many small random workloads whose prompts are computed in
chunks past the window: no answer of the block manager is ever rejected (a sequence that
must preempt itself while its grow would release blocks goes out with its tables as the pool
holds them), no swapped-out sequence waits forever (its swap-in counts what its next grow
releases; one that can never fit is recomputed), and the pool ends empty."""

from __future__ import annotations

import random

import pytest

from services.blockmgr.api.types import AttentionKindName, KVCacheGroup, PoolSpec
from services.blockmgr.client import InProcessClient
from services.common.sampling_params import SamplingParams
from services.executor.core.blockmgr_link import BlockManagerLink
from services.executor.core.scheduler import BadAnswer, Scheduler, SchedulerConfig
from services.executor.core.sequence import FinishReason, RequestKey, Sequence

BS, WINDOW, BUDGET, HOST = 4, 8, 16, 64


def _run(slides: tuple[bool, ...], num_blocks: int, seed: int) -> tuple[int, Scheduler]:
    """Six requests through plan / Step / apply / a stand-in forward; returns the answers
    rejected and the scheduler."""
    groups = tuple(
        KVCacheGroup(AttentionKindName.SLIDING, WINDOW) if s else KVCacheGroup() for s in slides
    )
    pool_id = f"swap-sliding-{len(slides)}-{num_blocks}-{seed}"
    link = BlockManagerLink(
        InProcessClient(), pool_id, PoolSpec(num_blocks, BS, True, groups=groups, host_blocks=HOST)
    )
    config = SchedulerConfig(
        block_size=BS,
        max_num_seqs=8,
        max_num_batched_tokens=BUDGET,
        sliding_window=WINDOW,
        kv_group_slides=slides if len(slides) > 1 else (),
        swap_slots=HOST,
        watermark_blocks=0,
    )
    sched = Scheduler(config, link.counters())
    rng = random.Random(seed)
    for i in range(6):
        prompt = [rng.randrange(3, 99) for _ in range(rng.randrange(20, 40))]
        params = SamplingParams(temperature=0.0, max_tokens=rng.randrange(5, 20), ignore_eos=True)
        sched.add(Sequence(i + 1, RequestKey(0, f"r{i}"), 0, prompt, len(prompt), params, 0, i))
    rejected = 0
    for _ in range(1500):
        if not sched.has_work:
            break
        plan = sched.plan()
        result = link.step(plan.ops(), lambda plan=plan: sched.pre_plan_state(plan))
        try:
            batch = sched.apply(plan, result)
        except BadAnswer:
            rejected += 1
            sched.abandon(plan)
            link.invalidate()
            continue
        sched.after_forward(batch.chunks)
        for chunk in batch.chunks:
            if chunk.need_logits:
                seq = chunk.seq
                seq.token_ids.append(3 + len(seq.token_ids) % 90)
                if len(seq.token_ids) - seq.prompt_len >= seq.params.max_tokens:
                    sched.finish(seq, FinishReason.LENGTH)
    return rejected, sched


@pytest.mark.parametrize(
    ("slides", "num_blocks"),
    [((True,), 9), ((True,), 11), ((True, False), 25), ((True, False), 31)],
)
def test_sliding_pools_swap_without_a_rejected_answer_or_a_stuck_sequence(
    slides: tuple[bool, ...], num_blocks: int
) -> None:
    swapped = 0
    for seed in range(12):
        rejected, sched = _run(slides, num_blocks, seed)
        assert rejected == 0, seed
        assert not sched.has_work, (seed, [(s.seq_id, s.host_slots) for s in sched.swapped])
        assert sched.num_free_blocks == sched.num_usable_blocks and not sched.mirror.refs, seed
        swapped += sched.swapping.num_swapped_out
    assert swapped > 0
