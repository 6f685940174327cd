"""The running sequences' part of a step's plan (:func:`plan_grows`): which of them compute
how many tokens, and which are preempted for room.

Decode tokens first, then prefill chunks, each in priority order, within the token budget.
A grow's blocks (and copy-on-write copies) come from the free blocks the mirror counts; when
a running sequence cannot grow, the lowest-priority (newest) unscheduled running sequence is
preempted, and only then: never while free blocks remain, and the oldest always progresses.
In a sliding-window pool every grow also releases the blocks that fell out of the window of
the sequence's queries still to come, as the block manager does at the same grow entry.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from services.executor.core.config import SchedulerConfig
from services.executor.core.plan import SchedulePlan
from services.executor.core.sequence import SeqStatus, Sequence
from services.executor.core.table_mirror import TableMirror

__all__ = ["plan_grows"]


def plan_grows(
    plan: SchedulePlan,
    running: list[Sequence],
    mirror: TableMirror,
    config: SchedulerConfig,
    *,
    free: int,
    budget: int,
    scheduled: set[int],
    preempt: Callable[[Sequence, SchedulePlan], int],
) -> tuple[int, int, bool]:
    """Add to ``plan`` the grows of the ``running`` sequences not ``scheduled`` yet, within
    ``free`` blocks and ``budget`` tokens; the mirror gives up the shares of copy-on-write
    grows and slides the sliding groups' tables. ``preempt(victim, plan)`` takes a running
    sequence out (its operations join ``plan``) and returns how many blocks that frees now.
    Returns the free blocks and the tokens left, and whether a sequence was preempted."""
    preempted = False

    def schedule(seq: Sequence, k: int) -> bool:
        nonlocal free, preempted
        # What its grow releases out of the window counts now, mirrored once granted:
        # preempted, it goes (or is swapped) out with its tables as the pool holds them.
        first = mirror.first_live_after(seq, seq.num_pool_tokens + seq.num_ahead_slots)
        releasing = mirror.releasable(seq, first) if window else 0
        free += releasing
        need = mirror.blocks_needed(seq, k)
        while need > free:
            victim = next(s for s in reversed(running) if s.seq_id not in scheduled)
            if victim is seq:
                free -= releasing
            free += preempt(victim, plan)
            preempted = True
            if victim is seq:
                return False
            need = mirror.blocks_needed(seq, k)
        if window:
            mirror.release_to(seq, first)
        free -= need
        cows = mirror.cow_groups(seq, k)
        if cows:  # mirror the pool: the writer drops its share of the block
            mirror.give_up_shares(seq, cows)
            plan.cow_ids[seq.seq_id] = cows
        scheduled.add(seq.seq_id)
        plan.grows.append((seq, k))
        plan.grow_blocks.append(need - len(cows))  # the copies' blocks come as BlockCopy
        if window:
            plan.grow_first_live.append(seq.first_live_block)
        return True

    # Decodes first, then prefill chunks of running sequences, in priority order.
    bs, refs, grows, grow_blocks = config.block_size, mirror.refs, plan.grows, plan.grow_blocks
    window, groups = config.sliding_window, config.num_kv_groups
    is_running = SeqStatus.RUNNING
    prefills: list[Sequence] = []  # (planning only removes from ``running``)
    for seq in list(running):
        if seq.status is not is_running or seq.seq_id in scheduled:
            continue
        computed = seq.num_computed_tokens
        seq.num_scheduled_drafts = 0
        if len(seq.token_ids) == computed:
            continue  # a beam waiting for a preempted sibling (engine_beams)
        if len(seq.token_ids) - computed != 1:
            prefills.append(seq)
        elif budget <= 0:
            continue
        elif seq.num_planned_drafts and budget > 1 and _private_tail(seq, refs, bs):
            # Speculative decoding: its token and its drafts, verified by this forward.
            drafts = min(seq.num_planned_drafts, budget - 1)
            seq.num_scheduled_drafts = drafts
            if schedule(seq, 1 + drafts):
                budget -= 1 + drafts
                plan.num_drafts += drafts
            else:
                seq.num_scheduled_drafts = 0
        elif (
            computed % bs
            and refs[seq.tables[0][-1]] == 1
            and (groups == 1 or all(refs[t[-1]] == 1 for t in seq.tables))
        ):
            # The common decode: room in a last block no one else holds.
            if window:
                free += mirror.slide(seq, seq.num_pool_tokens + seq.num_ahead_slots)
                plan.grow_first_live.append(seq.first_live_block)
            scheduled.add(seq.seq_id)
            grows.append((seq, 1))
            grow_blocks.append(0)
            budget -= 1
        elif schedule(seq, 1):
            budget -= 1
    for seq in prefills:
        if seq.status is not is_running or seq.seq_id in scheduled or budget <= 0:
            continue
        k = min(len(seq.token_ids) - seq.num_computed_tokens, budget)
        if schedule(seq, k):
            budget -= k
    return free, budget, preempted


def _private_tail(seq: Sequence, refs: Counter[int], block_size: int) -> bool:
    """Whether no other table holds a block ``seq`` may write in this step (from the one its
    first token the pool has not counted lands in): a speculative grow never copies on write
    (the pool's copy-on-write check and ours then agree whatever the drafts)."""
    start = seq.num_pool_tokens // block_size
    return all(refs[b] == 1 for table in seq.tables for b in table[start:])
