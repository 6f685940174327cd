"""The iteration-level scheduler (pure logic: no gRPC, no torch).

Every step the scheduler turns its queues into one ordered list of block-manager operations
(commit, free, fork, grow, admit), and after the block manager answered, into the chunks the
model computes. It keeps a local mirror of the refcounts of the blocks its sequences hold, so
that it knows exactly how many blocks a free releases and which grows need a copy-on-write:
it is the only client of its pool, so the mirror is exact, and it preempts only when the
pool's free blocks truly cannot cover the step.

Order within a step: decode tokens of running sequences first (priority order), then prefill
chunks of running sequences, then admissions of waiting ones, all within
``max_num_batched_tokens`` and ``max_num_seqs``. When a running sequence cannot grow, the
lowest-priority (newest) unscheduled running sequence is preempted by recompute: its blocks are
freed and it waits, to be re-admitted later with all its tokens.

In a sliding-window pool (``SchedulerConfig.sliding_window``) every grow also releases the
blocks that fell out of the window of the sequence's queries still to come (the block manager
applies the same rule, :func:`services.common.blocks.first_live_block`, at the same grow
entry); their table entries become the null block. A hybrid pool (several KV-cache groups,
``SchedulerConfig.kv_group_slides``) gives each sequence one table per group, of equal length:
every grow adds the same number of blocks to each, and only the sliding groups release.
"""

from __future__ import annotations

import bisect
import itertools
from collections import Counter
from collections.abc import Iterable

import structlog

from services.blockmgr.api.types import (
    AdmitResult,
    Commit,
    Fork,
    GrowResult,
    OpStatus,
    PoolCounters,
    RestoredSequence,
    StepResult,
    Uncache,
)
from services.common.blocks import NULL_BLOCK, first_live_block
from services.executor.core.admission import plan_admissions
from services.executor.core.ahead import AheadScheduling
from services.executor.core.config import SchedulerConfig
from services.executor.core.held_back import HeldBackChunks
from services.executor.core.plan import (
    BadAnswer,
    ScheduledBatch,
    ScheduledChunk,
    SchedulePlan,
    check_answer,
    extend_tables,
    split_tables,
    step_moves,
)
from services.executor.core.sequence import FinishReason, SeqStatus, Sequence
from services.executor.core.swapping import Swapping
from services.executor.core.table_mirror import TableMirror
from services.executor.core.tier_failures import TierFailures

__all__ = [
    "BadAnswer",
    "SchedulePlan",
    "ScheduledBatch",
    "ScheduledChunk",
    "Scheduler",
    "SchedulerConfig",
]

log = structlog.get_logger(__name__)


class Scheduler(AheadScheduling, HeldBackChunks, TierFailures, TableMirror, Swapping):
    def __init__(self, config: SchedulerConfig, counters: PoolCounters) -> None:
        self.config = config
        self.waiting: list[Sequence] = []  # sorted by sort_key
        self.running: list[Sequence] = []  # sorted by sort_key
        self.num_free_blocks = counters.num_free_blocks
        self.num_usable_blocks = counters.num_usable_blocks
        self.refs: Counter[int] = Counter()  # block id -> how many of our tables hold it
        self._to_free: list[RestoredSequence] = []  # the pool's view of seqs to free next Step
        self._forks: dict[int, Fork] = {}  # child seq_id -> pending Fork, sent next Step
        self._commits: list[Commit] = []
        self.num_preemptions = 0
        self.swapped: list[Sequence] = []  # swapped out (swapping.py), sorted by sort_key
        self.swap_slots_used = 0
        self.num_swapped_out = 0
        self.granted: list[tuple[Sequence, int]] = []  # held back (held_back.py)
        self._uncache: Uncache | None = None  # failed moves to report (tier_failures.py)
        self.num_chunks_held_back = 0

    # ---- queue management -----------------------------------------------------------------

    @property
    def has_work(self) -> bool:
        pending = self._to_free or self._commits or self._uncache
        return bool(self.waiting or self.running or self.swapped or pending)

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence for admission."""
        seq.status = SeqStatus.WAITING
        bisect.insort(self.waiting, seq, key=_sort_key)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """``child`` (a sample of an n > 1 request, its first token drawn from ``parent``'s
        logits; or a beam continuing ``parent`` with another token) shares all of
        ``parent``'s blocks from now on; the Fork is sent first thing in
        the next step. When ``max_num_seqs`` sequences already run, it waits instead and is
        admitted later like a preempted sequence (its prompt blocks are prefix hits then)."""
        child.num_cached_tokens = parent.num_cached_tokens
        child.admitted_once = True
        if len(self.running) >= self.config.max_num_seqs or parent.status is not SeqStatus.RUNNING:
            self.add(child)  # (a beam's parent may have been preempted: nothing to share)
            return
        child.tables = [list(t) for t in parent.tables]
        child.first_live_block = parent.first_live_block
        for table in child.tables:
            for b in table:
                if b != NULL_BLOCK:
                    self.refs[b] += 1
        child.num_computed_tokens = parent.num_computed_tokens
        bs = self.config.block_size
        shared = (len(child.token_ids) - 1) // bs  # full blocks of the tokens they share
        child.num_committed_blocks = min(parent.num_committed_blocks, shared)
        child.block_hashes = parent.block_hashes[:shared]
        child.status = SeqStatus.RUNNING
        bisect.insort(self.running, child, key=_sort_key)
        self._forks[child.seq_id] = Fork(parent.seq_id, child.seq_id)

    def finish(self, seq: Sequence, reason: FinishReason, stop_token: int | None = None) -> None:
        """Retire a sequence (idempotent). Its blocks are freed by the next step's Step."""
        if seq.status is SeqStatus.FINISHED:
            return
        if seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)
        elif seq.status is SeqStatus.SWAPPED:
            self._free_swapped(seq)
        else:
            self.running.remove(seq)
            self._drop_blocks(seq)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        seq.stop_token = stop_token

    # ---- phase one: plan ------------------------------------------------------------------

    def plan(self) -> SchedulePlan:
        cfg = self.config
        plan, free = self._open_plan()
        budget = cfg.max_num_batched_tokens
        scheduled: set[int] = set()
        preempted = False

        def schedule(seq: Sequence, k: int) -> bool:
            nonlocal free, preempted
            # What its grow releases out of the window counts now, mirrored once granted:
            # preempted, it goes (or is swapped) out with its tables as the pool holds them.
            first = self._first_live_after(seq, seq.num_computed_tokens + seq.num_ahead_slots)
            releasing = self._releasable(seq, first) if window else 0
            free += releasing
            need = self._blocks_needed(seq, k)
            while need > free:
                victim = next(s for s in reversed(self.running) if s.seq_id not in scheduled)
                if victim is seq:
                    free -= releasing
                free += self._preempt_for_room(victim, plan)
                preempted = True
                if victim is seq:
                    return False
                need = self._blocks_needed(seq, k)
            if window:
                self._release_to(seq, first)
            free -= need
            cows = self._cow_groups(seq, k)
            if cows:  # mirror the pool: the writer drops its share of the block
                for g in cows:
                    self.refs[seq.tables[g][-1]] -= 1
                plan.cow_ids[seq.seq_id] = cows
            scheduled.add(seq.seq_id)
            plan.grows.append((seq, k))
            plan.grow_blocks.append(need - len(cows))  # the copies' blocks come as BlockCopy
            if window:
                plan.grow_first_live.append(seq.first_live_block)
            return True

        # Decodes first, then prefill chunks of running sequences, in priority order.
        bs, refs, grows, grow_blocks = cfg.block_size, self.refs, plan.grows, plan.grow_blocks
        window, groups = cfg.sliding_window, cfg.num_kv_groups
        running = SeqStatus.RUNNING
        budget -= self._plan_granted(plan, scheduled)
        prefills: list[Sequence] = []  # (planning only removes from ``running``)
        for seq in list(self.running):
            if seq.status is not running or seq.seq_id in scheduled:
                continue
            computed = seq.num_computed_tokens
            if len(seq.token_ids) == computed:
                continue  # a beam waiting for a preempted sibling (engine_beams)
            if len(seq.token_ids) - computed != 1:
                prefills.append(seq)
            elif budget <= 0:
                continue
            elif (
                computed % bs
                and refs[seq.tables[0][-1]] == 1
                and (groups == 1 or all(refs[t[-1]] == 1 for t in seq.tables))
            ):
                # The common decode: room in a last block no one else holds.
                if window:
                    free += self._slide(seq, computed + seq.num_ahead_slots)
                    plan.grow_first_live.append(seq.first_live_block)
                scheduled.add(seq.seq_id)
                grows.append((seq, 1))
                grow_blocks.append(0)
                budget -= 1
            elif schedule(seq, 1):
                budget -= 1
        for seq in prefills:
            if seq.status is not running or seq.seq_id in scheduled or budget <= 0:
                continue
            k = min(len(seq.token_ids) - seq.num_computed_tokens, budget)
            if schedule(seq, k):
                budget -= k

        # Children preempted while planning cancelled their own forks.
        plan.forks = list(self._forks.values())
        plan.fork_ids = set(self._forks)
        self._forks = {}
        # No admissions in a step that had to preempt: the pool is under pressure. Swapped-out
        # sequences come back before anything new is admitted.
        if not preempted:
            if self.swapped:
                self._plan_swap_ins(plan, free)
            else:
                self._plan_admissions(plan, free, budget)
        return plan

    def _open_plan(self) -> tuple[SchedulePlan, int]:
        """A new plan carrying the pending commits and frees, and the free blocks after them."""
        plan = SchedulePlan(
            uncache=self._take_uncache(), commits=self._commits, released=self._to_free
        )
        free = self.num_free_blocks
        for view in self._to_free:
            free += self._release(view.block_ids)
            plan.free_seq_ids.append(view.seq_id)
        self._to_free, self._commits = [], []
        return plan, free

    def _plan_admissions(self, plan: SchedulePlan, free: int, budget: int) -> None:
        plan_admissions(plan, self.waiting, self.running, self.config, free, budget)

    def _check_answer(
        self, plan: SchedulePlan, grow: GrowResult | None, admitted: list[AdmitResult]
    ) -> None:
        check_answer(
            plan,
            grow,
            admitted,
            block_size=self.config.block_size,
            num_blocks=self.num_usable_blocks + 1,
            refs=self.refs,
            sliding_window=self.config.sliding_window,
            group_slides=self.config.group_slides,
        )

    # ---- phase two: apply the block manager's answer ---------------------------------------

    def apply(self, plan: SchedulePlan, result: StepResult) -> ScheduledBatch:
        """Take the block manager's answer to ``plan``: new blocks, copies, admissions.

        The answer is checked against what the plan asked for before anything changes; one
        that contradicts it raises :class:`BadAnswer` and changes nothing (see
        :meth:`abandon`)."""
        grow, admitted = plan.answers(result)
        self._check_answer(plan, grow, admitted)
        if plan.swap_outs or plan.swap_ins:
            self._check_swaps(plan, result)
            self._apply_swaps(plan, result)
        copies: list[tuple[int, int]] = []
        grows = plan.grows
        if grow is not None:
            failed = self._apply_grow(plan, grow, copies)
            if failed:
                grows = [(s, k) for s, k in grows if s.seq_id not in failed]
        new_prefills = self._apply_admissions(plan, admitted)
        self.num_free_blocks = result.counters.num_free_blocks
        chunks = [
            ScheduledChunk(s, k, s.num_computed_tokens + k == len(s.token_ids))
            for s, k in itertools.chain(grows, self._take_granted(plan), new_prefills)
        ]
        return ScheduledBatch(self._hold_back(chunks, result), copies, *step_moves(result))

    def _apply_admissions(
        self, plan: SchedulePlan, admitted: list[AdmitResult]
    ) -> list[tuple[Sequence, int]]:
        """Run the admitted sequences (the others stay waiting, in their place); returns each
        with the tokens of its first chunk."""
        new_prefills: list[tuple[Sequence, int]] = []
        for (seq, _), res in zip(plan.admits, admitted, strict=True):
            if res.status is not OpStatus.OK:
                continue
            self.waiting.remove(seq)
            seq.tables = split_tables(res.block_ids, self.config.num_kv_groups)
            # Leading null entries (sliding groups): released, out of its first query's window.
            seq.first_live_block = first_live_block(
                res.num_cached_tokens, self.config.sliding_window, self.config.block_size
            )
            for b in res.block_ids:
                if b != NULL_BLOCK:
                    self.refs[b] += 1
            seq.num_computed_tokens = res.num_cached_tokens
            seq.num_committed_blocks = res.num_cached_tokens // self.config.block_size
            if not seq.admitted_once:  # (a resumed sample's output may hit too: not counted)
                seq.num_cached_tokens = min(res.num_cached_tokens, seq.prompt_len)
                seq.admitted_once = True
            seq.status = SeqStatus.RUNNING
            bisect.insort(self.running, seq, key=_sort_key)
            new_prefills.append((seq, res.num_tokens - res.num_cached_tokens))
        return new_prefills

    def _apply_grow(
        self, plan: SchedulePlan, grow: GrowResult, copies: list[tuple[int, int]]
    ) -> set[int]:
        failed: set[int] = set()
        seqs = [s for s, _ in plan.grows]
        refs, ok = self.refs, OpStatus.OK
        if grow.statuses.count(ok) == len(seqs):  # the common case: every grow went through
            for seq, new_ids in zip(seqs, grow.new_block_ids, strict=True):
                if new_ids:
                    extend_tables(seq.tables, new_ids)
                    for b in new_ids:
                        refs[b] += 1
        else:
            failed = self._apply_grow_statuses(plan, seqs, grow)
        for copy in grow.copies:
            seq = seqs[copy.entry]
            # A new list, never an edit in place: runners mirror tables that only grow
            # (see forward_batch.SeqChunk).
            table = list(seq.tables[copy.group])
            table[copy.block_index] = copy.dst
            seq.tables[copy.group] = table
            refs[copy.dst] += 1
            copies.append((copy.src, copy.dst))
        if failed:
            for seq in seqs:
                if seq.seq_id in failed:
                    self._requeue_refused(seq)
        return failed

    def _apply_grow_statuses(
        self, plan: SchedulePlan, seqs: list[Sequence], grow: GrowResult
    ) -> set[int]:
        failed: set[int] = set()
        for seq, status, new_ids in zip(seqs, grow.statuses, grow.new_block_ids, strict=True):
            if status is not OpStatus.OK:
                # Our counters said it fits; the pool disagrees: recompute it later.
                log.warning("grow_refused", seq_id=seq.seq_id, status=status.name)
                failed.add(seq.seq_id)
                for g in plan.cow_ids.get(seq.seq_id, ()):  # it still holds its share
                    self.refs[seq.tables[g][-1]] += 1
                continue
            extend_tables(seq.tables, new_ids)
            for b in new_ids:
                self.refs[b] += 1
        return failed

    def abandon(self, plan: SchedulePlan) -> None:
        """Forget the answer to ``plan`` (it contradicted the plan): grows and admissions did
        not happen. The refcount mirror takes back the shares copy-on-write grows gave up;
        frees, preemptions, forks and commits of the plan stand. The pool must then be rebuilt
        from this state (a resync) before the next Step."""
        for seq, _ in plan.grows:
            if seq.tables[0]:
                for g in plan.cow_ids.get(seq.seq_id, ()):
                    self.refs[seq.tables[g][-1]] += 1
        if plan.swap_outs:
            self._unswap(plan)

    # ---- after the forward ----------------------------------------------------------------

    def after_forward(self, chunks: Iterable[ScheduledChunk]) -> int:
        """Advance computed counts and queue commits of newly full blocks for the next step.
        Returns the number of prompt tokens the chunks computed (recomputation included)."""
        bs, caching = self.config.block_size, self.config.enable_prefix_caching
        num_prompt_tokens = 0
        for seq, k, _ in chunks:
            start = seq.num_computed_tokens
            if start < seq.prompt_len:
                num_prompt_tokens += min(start + k, seq.prompt_len) - start
            seq.num_computed_tokens = computed = start + k
            seq.num_ahead_slots = 0
            if caching and computed // bs > seq.num_committed_blocks:
                full = computed // bs
                hashes = seq.full_block_hashes(bs)[seq.num_committed_blocks : full]
                self._commits.append(Commit(seq.seq_id, seq.num_committed_blocks, tuple(hashes)))
                seq.num_committed_blocks = full
        return num_prompt_tokens

    # ---- recovery -------------------------------------------------------------------------

    def pool_view(self, seq: Sequence) -> RestoredSequence:
        """What the block manager holds for ``seq``: its slots, table and committed hashes
        (a swapped-out sequence: its host slots instead of a table)."""
        if seq.status is SeqStatus.SWAPPED:
            return RestoredSequence(
                seq.seq_id,
                seq.num_computed_tokens,
                (),
                tuple(seq.block_hashes[: seq.num_committed_blocks]),
                seq.host_slots,
            )
        return RestoredSequence(
            seq.seq_id,
            seq.num_computed_tokens + seq.num_ahead_slots,
            tuple(seq.tables[0]) if len(seq.tables) == 1 else tuple(itertools.chain(*seq.tables)),
            tuple(seq.block_hashes[: seq.num_committed_blocks]),
        )

    def pre_plan_state(self, plan: SchedulePlan | None) -> list[RestoredSequence]:
        """The pool's sequences as they were before ``plan``'s operations (as they are now,
        without a plan): a restarted block manager restored to this state can take the same
        operations again."""
        if plan is None:
            forked: set[int] = set(self._forks)
            released = list(self._to_free)
        else:
            forked, released = plan.fork_ids, plan.released
        live = [self.pool_view(s) for s in self.running if s.tables[0] and s.seq_id not in forked]
        if self.swapped:
            live += self.swapped_views()
        return live + released

    # ---- internals ------------------------------------------------------------------------

    def _drop_blocks(self, seq: Sequence) -> int:
        """Give up ``seq``'s blocks. A fork not yet sent is cancelled: nothing to free in the
        pool, and the blocks that only it held in our mirror are free now (returned). Otherwise
        the Free goes out with the next Step."""
        freed = 0
        if self._forks.pop(seq.seq_id, None) is not None:
            freed = sum(self._release(t) for t in seq.tables)
        elif seq.tables[0]:
            self._to_free.append(self.pool_view(seq))
        seq.tables = [[] for _ in seq.tables]
        return freed

    def _preempt_for_room(self, seq: Sequence, plan: SchedulePlan) -> int:
        """Preempt a running sequence while planning: its Free joins this step's operations.
        Returns how many blocks this frees now."""
        if self._can_swap(seq):
            return self._swap_out(seq, plan)
        if seq.tables[0] and seq.seq_id not in self._forks:
            plan.free_seq_ids.append(seq.seq_id)
            plan.released.append(self.pool_view(seq))
            freed = sum(self._release(t) for t in seq.tables)
            seq.tables = [[] for _ in seq.tables]
        else:  # a pending fork is cancelled
            freed = self._drop_blocks(seq)
        self._requeue(seq)
        return freed

    def preempt(self, seq: Sequence) -> None:
        """Preempt a running sequence between steps (recomputed when admitted again); its
        Free goes out with the next Step."""
        if seq.status is SeqStatus.RUNNING:
            self._requeue_refused(seq)

    def _requeue_refused(self, seq: Sequence) -> None:
        """Preempt a sequence whose grow the pool refused after the fact: its Free goes out
        with the next Step."""
        self._drop_blocks(seq)
        self._requeue(seq)

    def _requeue(self, seq: Sequence) -> None:
        """Move a running sequence that gave up its blocks back to waiting (recompute)."""
        self.running.remove(seq)
        seq.num_computed_tokens = 0
        seq.num_ahead_slots = 0
        seq.num_committed_blocks = 0
        seq.first_live_block = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        seq.status = SeqStatus.WAITING
        bisect.insort(self.waiting, seq, key=_sort_key)
        log.warning(
            "sequence_preempted",
            req_id=seq.req_id,
            seq_id=seq.seq_id,
            num_tokens=seq.num_tokens,
            num_preemptions=seq.num_preemptions,
        )


def _sort_key(seq: Sequence) -> tuple[int, int, int]:
    return seq.sort_key
