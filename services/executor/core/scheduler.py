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
import itertools
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import NamedTuple

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
from services.common.blocks import blocks_for_tokens, blocks_to_grow, needs_cow
from services.executor.core.sequence import FinishReason, SeqStatus, Sequence

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class SchedulerConfig:
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    watermark_blocks: int = 1  # admissions must leave this many blocks free
    # Hold back an admission whose prompt blocks are being computed by another sequence in
    # this step (or a running prefill): it hits them, committed, a step later instead of
    # computing them again.
    hold_back_shared_prefixes: bool = True


class ScheduledChunk(NamedTuple):
    seq: Sequence
    num_new_tokens: int  # tokens computed for ``seq`` in this step
    need_logits: bool  # the chunk reaches the last known token: its logits are sampled


class BadAnswer(Exception):
    """The block manager's answer contradicts the plan it answers (wrong block counts, ids out
    of range or already held, a copy-on-write nobody asked for, ...). ``seq_ids``: the
    sequences concerned."""

    def __init__(self, message: str, seq_ids: set[int]) -> None:
        super().__init__(f"{message} (sequences {sorted(seq_ids)[:8]})")
        self.seq_ids = seq_ids


@dataclass
class SchedulePlan:
    """Phase one of a step: the operations to send, by part, and what they stand for.

    :meth:`ops` lays the parts out as one Step and :meth:`answers` reads the block manager's
    per-op results back by the same layout; nothing else knows op positions."""

    commits: list[Commit] = field(default_factory=list)
    forks: list[Fork] = field(default_factory=list)
    free_seq_ids: list[int] = field(default_factory=list)
    grows: list[tuple[Sequence, int]] = field(default_factory=list)  # decodes, then prefills
    grow_blocks: list[int] = field(default_factory=list)  # new blocks each grow must get
    admits: list[tuple[Sequence, Admit]] = field(default_factory=list)
    released: list[RestoredSequence] = field(default_factory=list)  # freed by this plan
    fork_ids: set[int] = field(default_factory=set)  # children forked by this plan
    cow_ids: set[int] = field(default_factory=set)  # grows the mirror counted as COW

    def ops(self) -> list[Operation]:
        """The Step's operations: commits, forks (before frees: a parent finished in the last
        step still lends its blocks), frees, one grow, admissions."""
        ops: list[Operation] = [*self.commits, *self.forks]
        if self.free_seq_ids:
            ops.append(Free(tuple(self.free_seq_ids)))
        if self.grows:
            ops.append(
                Grow(tuple(s.seq_id for s, _ in self.grows), tuple(k for _, k in self.grows))
            )
        ops.extend(admit for _, admit in self.admits)
        return ops

    def answers(self, result: StepResult) -> tuple[GrowResult | None, list[AdmitResult]]:
        """This plan's grow and admission results out of the answer to :meth:`ops`."""
        first = len(self.commits) + len(self.forks) + bool(self.free_seq_ids)
        expected = first + bool(self.grows) + len(self.admits)
        grow = result.results[first] if self.grows and len(result.results) > first else None
        admits = list(result.results[first + bool(self.grows) :])
        if (
            len(result.results) != expected
            or (self.grows and not isinstance(grow, GrowResult))
            or not all(isinstance(r, AdmitResult) for r in admits)
            or (
                grow is not None
                and not len(grow.statuses) == len(grow.new_block_ids) == len(self.grows)
            )
        ):
            raise BadAnswer(
                f"{len(result.results)} results for {expected} operations, or of the wrong kinds",
                {s.seq_id for s, _ in self.grows} | {s.seq_id for s, _ in self.admits},
            )
        return grow, admits  # type: ignore[return-value]


@dataclass(frozen=True)
class ScheduledBatch:
    """What the model computes in this step, and the block copies to make before it."""

    chunks: list[ScheduledChunk]  # decodes first, then prefill chunks
    copies: list[tuple[int, int]]  # copy-on-write (src, dst) block pairs


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

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence for admission."""
        seq.status = SeqStatus.WAITING
        bisect.insort(self.waiting, seq, key=_sort_key)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """``child`` (a sample of an n > 1 request, its first token drawn from ``parent``'s
        logits) shares all of ``parent``'s blocks from now on; the Fork is sent first thing in
        the next step. When ``max_num_seqs`` sequences already run, it waits instead and is
        admitted later like a preempted sequence (its prompt blocks are prefix hits then)."""
        child.num_cached_tokens = parent.num_cached_tokens
        child.admitted_once = True
        if len(self.running) >= self.config.max_num_seqs:
            self.add(child)
            return
        child.block_table = list(parent.block_table)
        for b in child.block_table:
            self.refs[b] += 1
        child.num_computed_tokens = parent.num_computed_tokens
        bs = self.config.block_size
        child.num_committed_blocks = min(parent.num_committed_blocks, child.prompt_len // bs)
        child.block_hashes = parent.block_hashes[: child.prompt_len // bs]
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
        plan, free = self._open_plan()
        budget = cfg.max_num_batched_tokens
        scheduled: set[int] = set()
        preempted = False

        def schedule(seq: Sequence, k: int) -> bool:
            nonlocal free, preempted
            need = self._blocks_needed(seq, k)
            while need > free:
                victim = next(s for s in reversed(self.running) if s.seq_id not in scheduled)
                free += self._preempt_for_room(victim, plan)
                preempted = True
                if victim is seq:
                    return False
                need = self._blocks_needed(seq, k)
            free -= need
            cow = self._cow(seq, k)
            if cow:  # mirror the pool: the writer drops its share of the block
                self.refs[seq.block_table[-1]] -= 1
                plan.cow_ids.add(seq.seq_id)
            scheduled.add(seq.seq_id)
            plan.grows.append((seq, k))
            plan.grow_blocks.append(need - cow)  # the copy's block comes as a BlockCopy
            return True

        # Decodes first, then prefill chunks of running sequences, in priority order.
        bs, refs, grows, grow_blocks = cfg.block_size, self.refs, plan.grows, plan.grow_blocks
        running = SeqStatus.RUNNING
        prefills: list[Sequence] = []  # (planning only removes from ``running``)
        for seq in list(self.running):
            if seq.status is not running or seq.seq_id in scheduled:
                continue
            computed = seq.num_computed_tokens
            if len(seq.token_ids) - computed != 1:
                prefills.append(seq)
            elif budget <= 0:
                continue
            elif computed % bs and refs[seq.block_table[-1]] == 1:
                # The common decode: room in a last block no one else holds.
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
        # No admissions in a step that had to preempt: the pool is under pressure.
        if not preempted:
            self._plan_admissions(plan, free, budget)
        return plan

    def _open_plan(self) -> tuple[SchedulePlan, int]:
        """A new plan carrying the pending commits and frees, and the free blocks after them."""
        plan = SchedulePlan(commits=self._commits, released=self._to_free)
        free = self.num_free_blocks
        for view in self._to_free:
            free += self._release(view.block_ids)
            plan.free_seq_ids.append(view.seq_id)
        self._to_free, self._commits = [], []
        return plan, free

    def plan_ahead(self, batch: ScheduledBatch) -> SchedulePlan | None:
        """Phase one of the *next* step, made before this step's forward (async scheduling),
        so that its Step round trip overlaps the forward.

        The running sequences are planned as :meth:`plan` would plan them once ``batch`` has
        run and been sampled: a sequence that samples a token now grows by that token's slot,
        whatever the token turns out to be (one that finishes gives the slot back in the step
        after; one whose token is its last by ``max_tokens`` is left out), then prefill chunks
        go on within the token budget, then waiting sequences are admitted. None (nothing
        changed) when the next step must be planned after sampling: samples about to fork, a
        copy-on-write, or too few free blocks without a preemption. Admissions that only the
        blocks freed by this step's finished sequences would make fit wait one step."""
        if not batch.chunks or self._forks:
            return None
        scheduled = {c.seq.seq_id: c for c in batch.chunks}
        decodes: list[tuple[Sequence, int]] = []  # (seq, slots it holds after this forward)
        prefills: list[tuple[Sequence, int, int]] = []  # (seq, slots, tokens left)
        for seq in self.running:
            chunk = scheduled.get(seq.seq_id)
            slots = seq.num_computed_tokens
            if chunk is None:
                left = len(seq.token_ids) - slots
            elif chunk.need_logits:  # samples a token now
                slots += chunk.num_new_tokens
                num_output = slots + 1 - seq.prompt_len
                if num_output == 1 and seq.params.n > 1:
                    return None  # its other samples fork from this token
                if num_output >= seq.params.max_tokens:
                    continue  # this token is its last: nothing to grow
                left = 1
            else:
                slots += chunk.num_new_tokens
                left = len(seq.token_ids) - slots
            if left == 1:
                decodes.append((seq, slots))
            else:
                prefills.append((seq, slots, left))
        bs, refs = self.config.block_size, self.refs
        budget = self.config.max_num_batched_tokens
        grows: list[tuple[Sequence, int]] = []
        grow_blocks: list[int] = []
        for seq, slots, left in itertools.chain(((s, n, 1) for s, n in decodes), prefills):
            if budget <= 0:
                break
            k = min(left, budget)
            table = seq.block_table
            if table and needs_cow(slots, k, bs, refs[table[-1]]):
                return None  # planned after sampling
            grows.append((seq, k))
            grow_blocks.append(blocks_to_grow(slots, k, len(table), bs))
            budget -= k
        need = sum(grow_blocks)
        if need > self.num_free_blocks or not (grows or self.waiting):
            return None  # (this step's frees are not counted: conservative)
        plan, free = self._open_plan()
        plan.grows, plan.grow_blocks = grows, grow_blocks
        self._plan_admissions(plan, free - need, budget)
        return plan

    def _plan_admissions(self, plan: SchedulePlan, free: int, budget: int) -> None:
        """Admit waiting sequences in priority order (FCFS within a priority).

        An admission must leave ``watermark_blocks`` plus one block per sequence that will be
        running free: each running sequence needs at most one new block in the next
        ``block_size`` steps, so this headroom keeps growth from preempting what was just
        admitted (admitting on prompt blocks alone makes the newest sequences thrash:
        admitted, preempted, recomputed, again). With nothing running no headroom is needed.
        """
        if not self.waiting:
            return
        cfg = self.config
        bs = cfg.block_size
        num_running = len(self.running)
        speculative = False
        admits = plan.admits
        hold_back = cfg.enable_prefix_caching and cfg.hold_back_shared_prefixes
        computing = self._uncommitted_prompt_blocks() if hold_back else set()
        for seq in self.waiting:
            if budget <= 0 or num_running + len(admits) >= cfg.max_num_seqs:
                break
            total = seq.num_tokens
            hashes = (
                tuple(seq.full_block_hashes(bs)[: total // bs]) if cfg.enable_prefix_caching else ()
            )
            if hold_back and hashes and not computing.isdisjoint(hashes):
                continue  # its prefix is being computed: it hits it, committed, next step
            if not cfg.enable_chunked_prefill and total > budget:
                break
            k_max = budget if cfg.enable_chunked_prefill else total
            first = min(total, k_max)
            upper = blocks_for_tokens(first, bs)  # blocks if nothing is cached
            others = num_running + len(admits)
            reserve = cfg.watermark_blocks + others if others else 0
            if upper + reserve > free:
                # A prefix hit may still make it fit: send it, but nothing after it (FCFS).
                if not cfg.enable_prefix_caching or speculative:
                    break
                speculative = True
            admits.append((seq, Admit(seq.seq_id, total, k_max, hashes, reserve)))
            computing.update(hashes)
            free -= min(upper, free)
            budget -= first
            if speculative:
                break

    def _uncommitted_prompt_blocks(self) -> set[bytes]:
        """Hashes of the full prompt blocks running sequences are computing but have not
        committed yet (a prefill in progress)."""
        bs = self.config.block_size
        blocks: set[bytes] = set()
        for seq in self.running:
            full = seq.prompt_len // bs
            if seq.num_committed_blocks < full:
                blocks.update(seq.full_block_hashes(bs)[seq.num_committed_blocks : full])
        return blocks

    # ---- phase two: apply the block manager's answer ---------------------------------------

    def apply(self, plan: SchedulePlan, result: StepResult) -> ScheduledBatch:
        """Take the block manager's answer to ``plan``: new blocks, copies, admissions.

        The answer is checked against what the plan asked for before anything changes; one
        that contradicts it raises :class:`BadAnswer` and changes nothing (see
        :meth:`abandon`)."""
        grow, admitted = plan.answers(result)
        self._check_answer(plan, grow, admitted)
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
            for s, k in itertools.chain(grows, new_prefills)
        ]
        return ScheduledBatch(chunks, copies)

    def apply_ahead(self, plan: SchedulePlan, result: StepResult) -> ScheduledBatch:
        """Take the answer to a :meth:`plan_ahead` plan, after this step's forward and
        :meth:`after_forward` but before sampling: the next step's batch (the grown
        sequences' chunks, then the first chunks of the admitted ones). Until that batch
        runs, ``num_ahead_slots`` counts the slots granted ahead. A grow the pool refused
        preempts its sequence, as in :meth:`apply` (it is still sampled in this step: its
        token joins what it recomputes). An answer that contradicts the plan raises
        :class:`BadAnswer` with nothing applied."""
        grow, admitted = plan.answers(result)
        self._check_answer(plan, grow, admitted)  # no copy-on-write either: one is rejected
        failed = self._apply_grow(plan, grow, []) if grow is not None else set()
        chunks: list[ScheduledChunk] = []
        append, new = chunks.append, tuple.__new__  # hot: every sequence, every step
        for seq, k in plan.grows:
            if failed and seq.seq_id in failed:
                continue
            seq.num_ahead_slots = k
            # A sequence sampled in this step lacks its token yet: its chunk samples too.
            end = seq.num_computed_tokens + k
            append(new(ScheduledChunk, (seq, k, end >= len(seq.token_ids))))
        for seq, k in self._apply_admissions(plan, admitted):
            seq.num_ahead_slots = k
            append(ScheduledChunk(seq, k, seq.num_computed_tokens + k == len(seq.token_ids)))
        self.num_free_blocks = result.counters.num_free_blocks
        return ScheduledBatch(chunks, [])

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
                    seq.block_table.extend(new_ids)
                    for b in new_ids:
                        refs[b] += 1
        else:
            failed = self._apply_grow_statuses(plan, seqs, grow)
        for copy in grow.copies:
            seq = seqs[copy.entry]
            # A new list, never an edit in place: runners mirror tables that only grow
            # (see forward_batch.SeqChunk).
            table = list(seq.block_table)
            table[copy.block_index] = copy.dst
            seq.block_table = table
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
                if seq.seq_id in plan.cow_ids:  # it still holds its share of the old block
                    self.refs[seq.block_table[-1]] += 1
                continue
            seq.block_table.extend(new_ids)
            for b in new_ids:
                self.refs[b] += 1
        return failed

    def _check_answer(
        self, plan: SchedulePlan, grow: GrowResult | None, admitted: list[AdmitResult]
    ) -> None:
        """Raise :class:`BadAnswer` unless every entry got exactly what it asked for: the
        expected number of blocks, each new one in range and held by none of our tables, a
        copy-on-write exactly where our mirror expects one, and admissions whose cached prefix
        and slots add up."""
        bs, num_blocks, refs, ok = (
            self.config.block_size,
            self.num_usable_blocks + 1,
            self.refs,
            OpStatus.OK,
        )
        bad: set[int] = set()
        taken: set[int] = set()

        def fresh(ids: Iterable[int]) -> bool:
            for b in ids:
                if not 0 < b < num_blocks or refs[b] or b in taken:
                    return False
                taken.add(b)
            return True

        if grow is not None:
            counts = [len(ids) for ids in grow.new_block_ids]
            all_ok = grow.statuses.count(ok) == len(plan.grows)
            if counts != plan.grow_blocks or grow.copies or plan.cow_ids or not all_ok:
                copied: set[int] = set()
                for c in grow.copies:
                    if not 0 <= c.entry < len(plan.grows):
                        raise BadAnswer(
                            f"copy for grow entry {c.entry}", {s.seq_id for s, _ in plan.grows}
                        )
                    seq = plan.grows[c.entry][0]
                    table = seq.block_table
                    if (
                        seq.seq_id not in plan.cow_ids
                        or c.entry in copied
                        or not table
                        or c.block_index != len(table) - 1
                        or c.src != table[-1]
                        or not fresh((c.dst,))
                    ):
                        bad.add(seq.seq_id)
                    copied.add(c.entry)
                for i, ((seq, _), status, got, want) in enumerate(
                    zip(plan.grows, grow.statuses, counts, plan.grow_blocks, strict=True)
                ):
                    if status is ok:
                        if got != want or (seq.seq_id in plan.cow_ids) != (i in copied):
                            bad.add(seq.seq_id)
                    elif got or i in copied:
                        bad.add(seq.seq_id)
            for (seq, _), ids in zip(plan.grows, grow.new_block_ids, strict=True):
                if ids and not fresh(ids):
                    bad.add(seq.seq_id)
        for (seq, op), res in zip(plan.admits, admitted, strict=True):
            if res.status is not ok:
                continue
            cached, ids = res.num_cached_tokens, res.block_ids
            want = cached + min(op.num_prompt_tokens - cached, op.max_new_tokens)
            hits = cached // bs
            if (
                cached % bs
                or not 0 <= cached < op.num_prompt_tokens
                or hits > len(op.block_hashes)
                or res.num_tokens != want
                or len(ids) != blocks_for_tokens(want, bs)
                or len(set(ids)) != len(ids)
                or not all(0 < b < num_blocks for b in ids[:hits])
                or not fresh(ids[hits:])
            ):
                bad.add(seq.seq_id)
        if bad:
            raise BadAnswer("the block manager's answer contradicts the plan", bad)

    def abandon(self, plan: SchedulePlan) -> None:
        """Forget the answer to ``plan`` (it contradicted the plan): grows and admissions did
        not happen. The refcount mirror takes back the shares copy-on-write grows gave up;
        frees, preemptions, forks and commits of the plan stand. The pool must then be rebuilt
        from this state (a resync) before the next Step."""
        for seq, _ in plan.grows:
            if seq.seq_id in plan.cow_ids and seq.block_table:
                self.refs[seq.block_table[-1]] += 1

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
        """What the block manager holds for ``seq``: its slots, table and committed hashes."""
        return RestoredSequence(
            seq.seq_id,
            seq.num_computed_tokens + seq.num_ahead_slots,
            tuple(seq.block_table),
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
        live = [self.pool_view(s) for s in self.running if s.block_table and s.seq_id not in forked]
        return live + released

    # ---- internals ------------------------------------------------------------------------

    def _cow(self, seq: Sequence, k: int) -> bool:
        last_refs = self.refs[seq.block_table[-1]] if seq.block_table else 0
        return needs_cow(seq.num_computed_tokens, k, self.config.block_size, last_refs)

    def _blocks_needed(self, seq: Sequence, k: int) -> int:
        bs = self.config.block_size
        need = blocks_to_grow(seq.num_computed_tokens, k, len(seq.block_table), bs)
        return need + self._cow(seq, k)

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

    def _preempt_for_room(self, seq: Sequence, plan: SchedulePlan) -> int:
        """Preempt a running sequence while planning: its Free joins this step's operations.
        Returns how many blocks this frees now."""
        if seq.block_table and seq.seq_id not in self._forks:
            plan.free_seq_ids.append(seq.seq_id)
            plan.released.append(self.pool_view(seq))
            freed = self._release(seq.block_table)
            seq.block_table = []
        else:  # a pending fork is cancelled
            freed = self._drop_blocks(seq)
        self._requeue(seq)
        return freed

    def _requeue_refused(self, seq: Sequence) -> None:
        """Preempt a sequence whose grow the pool refused after the fact: its Free goes out
        with the next Step."""
        self._drop_blocks(seq)
        self._requeue(seq)

    def _requeue(self, seq: Sequence) -> None:
        """Move a running sequence that gave up its blocks back to waiting (recompute)."""
        self.running.remove(seq)
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


def _sort_key(seq: Sequence) -> tuple[int, int, int]:
    return seq.sort_key
