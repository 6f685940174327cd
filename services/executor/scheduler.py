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
"""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

import structlog

from services.blockmgr.types import (
    Admit,
    AdmitResult,
    Commit,
    Fork,
    Free,
    Grow,
    GrowResult,
    Operation,
    OpStatus,
    PoolCounters,
    RestoredSequence,
    StepResult,
)
from services.executor.sequence import FinishReason, SeqStatus, Sequence

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class SchedulerConfig:
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    watermark_blocks: int = 1  # admissions must leave this many blocks free


@dataclass(frozen=True, slots=True)
class ScheduledChunk:
    seq: Sequence
    num_new_tokens: int  # tokens computed for ``seq`` in this step

    @property
    def completes_known_tokens(self) -> bool:
        """True when this chunk reaches the last known token: its logits are sampled."""
        return self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens


@dataclass
class SchedulePlan:
    """Phase one of a step: the operations to send, and what they stand for."""

    ops: list[Operation] = field(default_factory=list)
    decodes: list[tuple[Sequence, int]] = field(default_factory=list)
    prefills: list[tuple[Sequence, int]] = field(default_factory=list)
    admissions: list[Sequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    released: list[RestoredSequence] = field(default_factory=list)  # freed by this plan
    fork_ids: set[int] = field(default_factory=set)  # children forked by this plan
    cow_ids: set[int] = field(default_factory=set)  # grows the mirror counted as COW
    grow_op_index: int = -1
    grow_seqs: list[Sequence] = field(default_factory=list)
    admit_op_index: int = -1


@dataclass
class StepPlan:
    """Phase two: what the model computes in this step."""

    chunks: list[ScheduledChunk]  # decodes first, then prefill chunks
    copies: list[tuple[int, int]]  # copy-on-write (src, dst) block pairs, before the forward
    preempted: list[Sequence]

    @property
    def num_tokens(self) -> int:
        return sum(c.num_new_tokens for c in self.chunks)


class Scheduler:
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

    # ---- queue management -----------------------------------------------------------------

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._to_free or self._commits)

    @property
    def num_sequences(self) -> int:
        return len(self.waiting) + len(self.running)

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence for admission."""
        seq.status = SeqStatus.WAITING
        bisect.insort(self.waiting, seq, key=_sort_key)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """``child`` shares all of ``parent``'s blocks from now on (n > 1 sampling). The Fork
        is sent first thing in the next step; ``child`` holds ``parent``'s computed tokens."""
        child.block_table = list(parent.block_table)
        for b in child.block_table:
            self.refs[b] += 1
        child.num_computed_tokens = parent.num_computed_tokens
        bs = self.config.block_size
        child.num_committed_blocks = min(parent.num_committed_blocks, child.prompt_len // bs)
        child.block_hashes = parent.block_hashes[: child.prompt_len // bs]
        child.num_cached_tokens = parent.num_cached_tokens
        child.admitted_once = True
        child.status = SeqStatus.RUNNING
        bisect.insort(self.running, child, key=_sort_key)
        self._forks[child.seq_id] = Fork(parent.seq_id, child.seq_id)

    def finish(self, seq: Sequence, reason: FinishReason, stop_token: int | None = None) -> None:
        """Retire a sequence (idempotent). Its blocks are freed by the next step's Step."""
        if seq.status is SeqStatus.FINISHED:
            return
        if seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)
        else:
            self.running.remove(seq)
            self._drop_blocks(seq)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        seq.stop_token = stop_token

    # ---- phase one: plan ------------------------------------------------------------------

    def plan(self) -> SchedulePlan:
        cfg = self.config
        plan = SchedulePlan()
        free = self.num_free_blocks
        free_ids: list[int] = []
        for view in self._to_free:
            free += self._release(view.block_ids)
            free_ids.append(view.seq_id)
        plan.released, self._to_free = self._to_free, []
        plan.fork_ids = set(self._forks)

        budget = cfg.max_num_batched_tokens
        scheduled: set[int] = set()
        grows: list[tuple[Sequence, int]] = []

        def schedule(seq: Sequence, k: int) -> bool:
            nonlocal free
            need = self._blocks_needed(seq, k)
            while need > free:
                victim = next(s for s in reversed(self.running) if s.seq_id not in scheduled)
                free += self._preempt(victim, free_ids, plan)
                plan.preempted.append(victim)
                if victim is seq:
                    return False
                need = self._blocks_needed(seq, k)
            free -= need
            if self._apply_cow_refs(seq, k):
                plan.cow_ids.add(seq.seq_id)
            scheduled.add(seq.seq_id)
            grows.append((seq, k))
            return True

        # Decodes first, then prefill chunks of running sequences, in priority order.
        for decode_pass in (True, False):
            for seq in list(self.running):
                if seq.status is not SeqStatus.RUNNING or seq.seq_id in scheduled:
                    continue
                remaining = seq.num_tokens - seq.num_computed_tokens
                if (remaining == 1) != decode_pass or budget <= 0:
                    continue
                k = min(remaining, budget)
                if schedule(seq, k):
                    budget -= k
                    (plan.decodes if decode_pass else plan.prefills).append((seq, k))

        # Forks before frees: a parent finished in the last step still lends its blocks.
        plan.fork_ids &= set(self._forks)  # minus children preempted while planning
        plan.ops = [*self._commits, *self._forks.values()]
        self._commits, self._forks = [], {}
        if free_ids:
            plan.ops.append(Free(tuple(free_ids)))
        if grows:
            plan.grow_op_index = len(plan.ops)
            plan.grow_seqs = [s for s, _ in grows]
            plan.ops.append(Grow(tuple(s.seq_id for s, _ in grows), tuple(k for _, k in grows)))
        # No admissions in a step that had to preempt: the pool is under pressure.
        if not plan.preempted:
            self._plan_admissions(plan, free, budget)
        return plan

    def _plan_admissions(self, plan: SchedulePlan, free: int, budget: int) -> None:
        """Admit waiting sequences in priority order (FCFS within a priority).

        An admission must leave ``watermark_blocks`` plus one block per sequence that will be
        running free: each running sequence needs at most one new block in the next
        ``block_size`` steps, so this headroom keeps growth from preempting what was just
        admitted (admitting on prompt blocks alone makes the newest sequences thrash:
        admitted, preempted, recomputed, again). With nothing running no headroom is needed.
        """
        cfg = self.config
        bs = cfg.block_size
        num_running = len(self.running)
        speculative = False
        admits: list[Admit] = []
        for seq in self.waiting:
            if budget <= 0 or num_running + len(admits) >= cfg.max_num_seqs:
                break
            total = seq.num_tokens
            if not cfg.enable_chunked_prefill and total > budget:
                break
            k_max = budget if cfg.enable_chunked_prefill else total
            first = min(total, k_max)
            upper = -(-first // bs)  # blocks if nothing is cached
            others = num_running + len(admits)
            reserve = cfg.watermark_blocks + others if others else 0
            if upper + reserve > free:
                # A prefix hit may still make it fit: send it, but nothing after it (FCFS).
                if not cfg.enable_prefix_caching or speculative:
                    break
                speculative = True
            hashes = (
                tuple(seq.full_block_hashes(bs)[: total // bs])
                if cfg.enable_prefix_caching
                else ()
            )
            admits.append(Admit(seq.seq_id, total, k_max, hashes, reserve))
            plan.admissions.append(seq)
            free -= min(upper, free)
            budget -= first
            if speculative:
                break
        if admits:
            plan.admit_op_index = len(plan.ops)
            plan.ops.extend(admits)

    # ---- phase two: apply the block manager's answer ---------------------------------------

    def apply(self, plan: SchedulePlan, result: StepResult) -> StepPlan:
        copies: list[tuple[int, int]] = []
        decodes = list(plan.decodes)
        prefills = list(plan.prefills)
        if plan.grow_op_index >= 0:
            grow = result.results[plan.grow_op_index]
            assert isinstance(grow, GrowResult)
            failed = self._apply_grow(plan, grow, copies)
            if failed:
                decodes = [(s, k) for s, k in decodes if s.seq_id not in failed]
                prefills = [(s, k) for s, k in prefills if s.seq_id not in failed]
        new_prefills: list[tuple[Sequence, int]] = []
        for i, seq in enumerate(plan.admissions):
            res = result.results[plan.admit_op_index + i]
            assert isinstance(res, AdmitResult)
            if res.status is not OpStatus.OK:
                continue  # stays waiting, in its place
            self.waiting.remove(seq)
            seq.block_table = list(res.block_ids)
            for b in res.block_ids:
                self.refs[b] += 1
            seq.num_computed_tokens = res.num_cached_tokens
            seq.num_committed_blocks = res.num_cached_tokens // self.config.block_size
            if not seq.admitted_once:
                seq.num_cached_tokens = res.num_cached_tokens
                seq.admitted_once = True
            seq.status = SeqStatus.RUNNING
            bisect.insort(self.running, seq, key=_sort_key)
            new_prefills.append((seq, res.num_tokens - res.num_cached_tokens))
        self.num_free_blocks = result.counters.num_free_blocks
        chunks = [ScheduledChunk(s, k) for s, k in (*decodes, *prefills, *new_prefills)]
        return StepPlan(chunks, copies, plan.preempted)

    def _apply_grow(
        self, plan: SchedulePlan, grow: GrowResult, copies: list[tuple[int, int]]
    ) -> set[int]:
        failed: set[int] = set()
        for seq, status, new_ids in zip(plan.grow_seqs, grow.statuses, grow.new_block_ids,
                                        strict=True):  # fmt: skip
            if status is not OpStatus.OK:
                # Our counters said it fits; the pool disagrees: recompute it later.
                log.warning("grow_refused", seq_id=seq.seq_id, status=status.name)
                failed.add(seq.seq_id)
                if seq.seq_id in plan.cow_ids:  # it still holds its share of the old block
                    self.refs[seq.block_table[-1]] += 1
                continue
            seq.block_table.extend(new_ids)
            for b in new_ids:
                self.refs[b] += 1
        for copy in grow.copies:
            seq = plan.grow_seqs[copy.entry]
            seq.block_table[copy.block_index] = copy.dst
            self.refs[copy.dst] += 1
            copies.append((copy.src, copy.dst))
        for seq in plan.grow_seqs:
            if seq.seq_id in failed:
                self._preempt(seq, None, None)
        return failed

    # ---- after the forward ----------------------------------------------------------------

    def after_forward(self, chunks: Iterable[ScheduledChunk]) -> None:
        """Advance computed counts and queue commits of newly full blocks for the next step."""
        bs = self.config.block_size
        for chunk in chunks:
            seq = chunk.seq
            seq.num_computed_tokens += chunk.num_new_tokens
            if not self.config.enable_prefix_caching:
                continue
            full = seq.num_computed_tokens // bs
            if full > seq.num_committed_blocks:
                hashes = seq.full_block_hashes(bs)[seq.num_committed_blocks : full]
                self._commits.append(Commit(seq.seq_id, seq.num_committed_blocks, tuple(hashes)))
                seq.num_committed_blocks = full

    # ---- recovery -------------------------------------------------------------------------

    def pool_view(self, seq: Sequence) -> RestoredSequence:
        """What the block manager holds for ``seq``: its slots, table and committed hashes."""
        return RestoredSequence(
            seq.seq_id,
            seq.num_computed_tokens,
            tuple(seq.block_table),
            tuple(seq.block_hashes[: seq.num_committed_blocks]),
        )

    def pre_plan_state(self, plan: SchedulePlan) -> list[RestoredSequence]:
        """The pool's sequences as they were before ``plan``'s operations: a restarted block
        manager restored to this state can take the same operations again."""
        live = [
            self.pool_view(s)
            for s in self.running
            if s.block_table and s.seq_id not in plan.fork_ids
        ]
        return live + plan.released

    # ---- internals ------------------------------------------------------------------------

    def _blocks_needed(self, seq: Sequence, k: int) -> int:
        bs = self.config.block_size
        held = len(seq.block_table)
        need = -(-(seq.num_computed_tokens + k) // bs) - held
        partial = seq.num_computed_tokens % bs != 0
        cow = k > 0 and partial and held > 0 and self.refs[seq.block_table[-1]] > 1
        return need + cow

    def _apply_cow_refs(self, seq: Sequence, k: int) -> bool:
        """Mirror the block manager: a COW grow drops the writer's share of the old block.
        Returns whether it did."""
        bs = self.config.block_size
        if k > 0 and seq.num_computed_tokens % bs and seq.block_table:
            last = seq.block_table[-1]
            if self.refs[last] > 1:
                self.refs[last] -= 1
                return True
        return False

    def _release(self, table: list[int]) -> int:
        """Drop one reference to each block of ``table``; return how many became free."""
        freed = 0
        refs = self.refs
        for b in table:
            refs[b] -= 1
            if refs[b] == 0:
                del refs[b]
                freed += 1
        return freed

    def _drop_blocks(self, seq: Sequence) -> int:
        """Give up ``seq``'s blocks. A fork not yet sent is cancelled: nothing to free in the
        pool, and the blocks that only it held in our mirror are free now (returned). Otherwise
        the Free goes out with the next Step."""
        freed = 0
        if self._forks.pop(seq.seq_id, None) is not None:
            freed = self._release(seq.block_table)
        elif seq.block_table:
            self._to_free.append(self.pool_view(seq))
        seq.block_table = []
        return freed

    def _preempt(
        self, seq: Sequence, free_ids: list[int] | None, plan: SchedulePlan | None
    ) -> int:
        """Move a running sequence back to waiting; return how many blocks this frees now.

        With ``free_ids`` (planning), the Free joins this step's operations; without (a grow
        the pool refused after the fact), it is deferred to the next step."""
        self.running.remove(seq)
        if free_ids is not None and seq.block_table and seq.seq_id not in self._forks:
            free_ids.append(seq.seq_id)
            if plan is not None:
                plan.released.append(self.pool_view(seq))
            freed = self._release(seq.block_table)
            seq.block_table = []
        else:  # a pending fork is cancelled; otherwise the Free goes out next step
            freed = self._drop_blocks(seq)
        seq.num_computed_tokens = 0
        seq.num_committed_blocks = 0
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
        return freed


def _sort_key(seq: Sequence) -> tuple[int, int, int]:
    return seq.sort_key
