"""A step's plan and its outcome: what the scheduler asks the block manager for
(:class:`SchedulePlan`), the check of the answer against it (:func:`check_answer`), and what
the model then computes (:class:`ScheduledBatch`)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import NamedTuple

from services.blockmgr.api.types import (
    Admit,
    AdmitResult,
    Commit,
    Fork,
    Free,
    Grow,
    GrowResult,
    Operation,
    OpStatus,
    RestoredSequence,
    StepResult,
    SwapIn,
    SwapInResult,
    SwapOut,
    SwapOutResult,
    Uncache,
)
from services.common.blocks import NULL_BLOCK, blocks_for_tokens, first_live_block
from services.executor.core.config import SchedulerConfig
from services.executor.core.sequence import Sequence

__all__ = [
    "BadAnswer",
    "SchedulePlan",
    "ScheduledBatch",
    "ScheduledChunk",
    "check_answer",
    "extend_tables",
    "grant",
    "granted_grows",
    "grow_counts",
    "hold_back_filled",
    "split_tables",
    "step_batch",
    "step_moves",
]


class ScheduledChunk(NamedTuple):
    seq: Sequence
    num_new_tokens: int  # tokens computed for ``seq`` in this step
    need_logits: bool  # the chunk reaches the last known token: its logits are sampled


def grow_counts(seq: Sequence, k: int) -> tuple[int, int]:
    """The grow entry of ``seq`` computing ``k`` tokens, ``seq.num_scheduled_drafts`` of them
    drafts: (verified tokens to add, lookahead slots). The verified ones are its real new
    tokens and the drafts accepted in its last step (``num_unreported``); the drafts are
    lookahead: only verified tokens count for commits and sliding windows."""
    drafts = seq.num_scheduled_drafts
    return k - drafts + seq.num_unreported, drafts


def grant(seq: Sequence, n: int, lookahead: int, reported: int) -> None:
    """The pool granted ``seq`` a grow of ``n`` verified tokens, ``reported`` of them accepted
    drafts, holding ``lookahead`` slots beyond them (speculative decoding on)."""
    seq.num_surplus_slots = max(seq.num_surplus_slots - n, lookahead)
    seq.num_unreported -= reported


def granted_grows(grows: Iterable[tuple[Sequence, int]]) -> None:
    """The pool granted these grows, planned after sampling: it counts their sequences'
    accepted drafts now, and holds their lookahead slots."""
    for seq, k in grows:
        grant(seq, *grow_counts(seq, k), seq.num_unreported)


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

    # First: the failed moves reported (their blocks and slots forgotten before anything).
    uncache: Uncache | None = None
    commits: list[Commit] = field(default_factory=list)
    forks: list[Fork] = field(default_factory=list)
    free_seq_ids: list[int] = field(default_factory=list)
    grows: list[tuple[Sequence, int]] = field(default_factory=list)  # decodes, then prefills
    grow_blocks: list[int] = field(default_factory=list)  # new blocks each grow must get
    # Sliding-window pools: each grow's first live block (in its sliding groups) once the
    # pool has applied it.
    grow_first_live: list[int] = field(default_factory=list)
    admits: list[tuple[Sequence, Admit]] = field(default_factory=list)
    num_drafts: int = 0  # draft tokens its grows compute (speculative decoding)
    # Speculative decoding is on: grows report accepted drafts and hold lookahead slots.
    speculative: bool = False
    # A speculative plan made ahead (async scheduling): each grow's (verified tokens,
    # lookahead slots, accepted drafts it reports), fixed when planned, as the sequences'
    # counts move before the answer comes (empty: read off the sequences, grow_counts).
    ahead_counts: list[tuple[int, int, int]] = field(default_factory=list)
    released: list[RestoredSequence] = field(default_factory=list)  # freed by this plan
    fork_ids: set[int] = field(default_factory=set)  # children forked by this plan
    # Grows the mirror counted as copy-on-write: seq_id -> the KV-cache groups to copy in.
    cow_ids: dict[int, tuple[int, ...]] = field(default_factory=dict)
    # Preemption by swapping: the sequences swapped out (with their table's length) and in.
    swap_outs: list[tuple[Sequence, list[list[int]]]] = field(default_factory=list)  # tables
    swap_ins: list[Sequence] = field(default_factory=list)
    # Chunks the pool granted in an earlier Step, held back while their blocks were filled
    # from a tier: they run in this plan's batch with no operation of their own.
    granted: list[tuple[Sequence, int]] = field(default_factory=list)

    def ops(self) -> list[Operation]:
        """The Step's operations: the failed moves reported, commits, forks (before frees: a
        parent finished in the last step still lends its blocks), frees, swap-outs, one grow,
        swap-ins, admissions."""
        ops: list[Operation] = [self.uncache] if self.uncache is not None else []
        ops += [*self.commits, *self.forks]
        if self.free_seq_ids:
            ops.append(Free(tuple(self.free_seq_ids)))
        if self.swap_outs:
            ops.append(SwapOut(tuple(s.seq_id for s, _ in self.swap_outs)))
        if self.grows:
            seq_ids = tuple(s.seq_id for s, _ in self.grows)
            if self.speculative:
                counts = (
                    [(n, la) for n, la, _ in self.ahead_counts]
                    if self.ahead_counts
                    else [grow_counts(s, k) for s, k in self.grows]
                )
                ops.append(
                    Grow(seq_ids, tuple(n for n, _ in counts), tuple(la for _, la in counts))
                )
            else:
                ops.append(Grow(seq_ids, tuple(k for _, k in self.grows)))
        if self.swap_ins:
            ops.append(SwapIn(tuple(s.seq_id for s in self.swap_ins)))
        ops.extend(admit for _, admit in self.admits)
        return ops

    def swap_answers(self, result: StepResult) -> tuple[SwapOutResult | None, SwapInResult | None]:
        """The swap-out and swap-in results (after :meth:`answers` checked the layout)."""
        first = self._first_after_frees()
        out = result.results[first] if self.swap_outs else None
        at = first + bool(self.swap_outs) + bool(self.grows)
        back = result.results[at] if self.swap_ins else None
        if not isinstance(out, SwapOutResult | None) or not isinstance(back, SwapInResult | None):
            raise BadAnswer("swap results of the wrong kinds", self.swap_ids())
        return out, back

    def _first_after_frees(self) -> int:
        """The position of the first result after the frees."""
        before = len(self.commits) + len(self.forks) + bool(self.free_seq_ids)
        return before + (self.uncache is not None)

    def swap_ids(self) -> set[int]:
        return {s.seq_id for s, _ in self.swap_outs} | {s.seq_id for s in self.swap_ins}

    def answers(self, result: StepResult) -> tuple[GrowResult | None, list[AdmitResult]]:
        """This plan's grow and admission results out of the answer to :meth:`ops`."""
        first = self._first_after_frees() + bool(self.swap_outs)
        expected = first + bool(self.grows) + bool(self.swap_ins) + len(self.admits)
        found = result.results[first] if self.grows and len(result.results) > first else None
        grow = found if isinstance(found, GrowResult) else None
        admits = list(result.results[first + bool(self.grows) + bool(self.swap_ins) :])
        if (
            len(result.results) != expected
            or (self.grows and grow is None)
            or not all(isinstance(r, AdmitResult) for r in admits)
            or (
                grow is not None
                and not len(grow.statuses) == len(grow.new_block_ids) == len(self.grows)
            )
        ):
            raise BadAnswer(
                f"{len(result.results)} results for {expected} operations, or of the wrong kinds",
                {s.seq_id for s, _ in self.grows}
                | {s.seq_id for s, _ in self.admits}
                | self.swap_ids(),
            )
        return grow, admits  # type: ignore[return-value]


@dataclass(frozen=True)
class ScheduledBatch:
    """What the model computes in this step, and the block copies to make before it."""

    chunks: list[ScheduledChunk]  # decodes first, then prefill chunks (LoRA: by adapter)
    copies: list[tuple[int, int]]  # copy-on-write (src, dst) block pairs
    # The tiers' moves, made before the copies (a copy may write into a block just
    # offloaded): spills (host slot, disk slot), offloads (device block, host slot), stores
    # (device block, disk slot), onboards (device block, host slot), loads (disk slot,
    # device block), in that order.
    offloads: tuple[tuple[int, int], ...] = ()
    onboards: tuple[tuple[int, int], ...] = ()
    spills: tuple[tuple[int, int], ...] = ()
    loads: tuple[tuple[int, int], ...] = ()
    stores: tuple[tuple[int, int], ...] = ()

    @property
    def has_moves(self) -> bool:
        return bool(self.offloads or self.onboards or self.spills or self.loads or self.stores)

    @property
    def moves(self) -> tuple[Moves, Moves, Moves, Moves, Moves]:
        return self.offloads, self.onboards, self.spills, self.loads, self.stores


def step_batch(
    chunks: list[ScheduledChunk],
    copies: list[tuple[int, int]],
    result: StepResult,
    config: SchedulerConfig,
) -> ScheduledBatch:
    """The batch of a step whose Step answered ``result``. With multi-LoRA serving its chunks
    are grouped by adapter (stable: in scheduling order within one), so each adapter's rows
    are one slice of the token axis."""
    if config.max_loras:
        chunks.sort(key=lambda c: c.seq.lora_id)
    return ScheduledBatch(chunks, copies, *step_moves(result))


Moves = tuple[tuple[int, int], ...]
# The kinds of :attr:`ScheduledBatch.moves`, in its order.
MOVE_KINDS = ("offload", "onboard", "spill", "load", "store")


def step_moves(result: StepResult) -> tuple[Moves, Moves, Moves, Moves, Moves]:
    """The tiers' (offloads, onboards, spills, loads, stores) of a Step, as id pairs."""
    return (
        tuple((m.device_block, m.host_slot) for m in result.offloads),
        tuple((m.device_block, m.host_slot) for m in result.onboards),
        tuple((m.src, m.dst) for m in result.spills),
        tuple((m.src, m.dst) for m in result.loads),
        tuple((m.src, m.dst) for m in result.stores),
    )


def hold_back_filled(
    chunks: list[ScheduledChunk], result: StepResult, granted: list[tuple[Sequence, int]]
) -> list[ScheduledChunk]:
    """``chunks`` less those whose tables hold a block one of ``result``'s fills (onboards,
    loads) writes: these wait for the next step, their fills running beside this step's
    forward. Each goes to ``granted``, its slots counted in ``num_ahead_slots``."""
    if not (result.onboards or result.loads):
        return chunks
    filled = {m.device_block for m in result.onboards}
    filled.update(m.dst for m in result.loads)
    run: list[ScheduledChunk] = []
    for c in chunks:
        if any(not filled.isdisjoint(t) for t in c.seq.tables):
            c.seq.num_ahead_slots = c.num_new_tokens
            granted.append((c.seq, c.num_new_tokens))
        else:
            run.append(c)
    return run


def split_tables(block_ids: tuple[int, ...], num_groups: int) -> list[list[int]]:
    """A sequence's tables out of the contract's group-major concatenation."""
    if num_groups == 1:
        return [list(block_ids)]
    n = len(block_ids) // num_groups
    return [list(block_ids[g * n : (g + 1) * n]) for g in range(num_groups)]


def extend_tables(tables: list[list[int]], new_ids: tuple[int, ...]) -> None:
    """Append a grow entry's new blocks (equal runs, group-major) to each group's table."""
    if len(tables) == 1:
        tables[0].extend(new_ids)
        return
    n = len(new_ids) // len(tables)
    for g, table in enumerate(tables):
        table.extend(new_ids[g * n : (g + 1) * n])


def check_answer(
    plan: SchedulePlan,
    grow: GrowResult | None,
    admitted: list[AdmitResult],
    *,
    block_size: int,
    num_blocks: int,
    refs: Counter[int],
    sliding_window: int = 0,
    group_slides: tuple[bool, ...] = (),
) -> None:
    """Raise :class:`BadAnswer` unless every entry got exactly what it asked for: the
    expected number of blocks, each new one in range and held by none of our tables, a
    copy-on-write exactly where our mirror expects one, and admissions whose cached prefix
    and slots add up. ``refs``: the scheduler's refcount mirror (blocks its tables hold);
    ``num_blocks``: the pool's size, the null block included. In a sliding-window pool
    (``sliding_window``; ``group_slides``: which of the pool's KV-cache groups slide, by
    default one that does iff the window is set), each grow entry's first live block must be
    the one the mirror released up to in its sliding groups and 0 in the others, and an
    admission's tables must start with exactly the null entries out of its first query's
    window in the sliding groups, and hold none in the others."""
    bs, ok = block_size, OpStatus.OK
    slides = group_slides or (bool(sliding_window),)
    num_groups = len(slides)
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
            copied: dict[int, set[int]] = {}  # entry -> groups copied
            for c in grow.copies:
                if not 0 <= c.entry < len(plan.grows) or not 0 <= c.group < num_groups:
                    raise BadAnswer(
                        f"copy for grow entry {c.entry}, group {c.group}",
                        {s.seq_id for s, _ in plan.grows},
                    )
                seq = plan.grows[c.entry][0]
                table = seq.tables[c.group]
                groups = copied.setdefault(c.entry, set())
                if (
                    c.group not in plan.cow_ids.get(seq.seq_id, ())
                    or c.group in groups
                    or not table
                    or c.block_index != len(table) - 1
                    or c.src != table[-1]
                    or not fresh((c.dst,))
                ):
                    bad.add(seq.seq_id)
                groups.add(c.group)
            for i, ((seq, _), status, got, want) in enumerate(
                zip(plan.grows, grow.statuses, counts, plan.grow_blocks, strict=True)
            ):
                if status is ok:
                    if got != want or set(plan.cow_ids.get(seq.seq_id, ())) != copied.get(i, set()):
                        bad.add(seq.seq_id)
                elif got or i in copied:
                    bad.add(seq.seq_id)
        for (seq, _), ids in zip(plan.grows, grow.new_block_ids, strict=True):
            if ids and not fresh(ids):
                bad.add(seq.seq_id)
        if sliding_window:  # (a refused grow releases nothing: its sequence is requeued)
            live = grow.first_live_blocks
            if len(live) != len(plan.grows) * num_groups:
                bad.update(s.seq_id for s, _ in plan.grows)
            else:
                for i, ((seq, _), status, want) in enumerate(
                    zip(plan.grows, grow.statuses, plan.grow_first_live, strict=True)
                ):
                    lives = live[i * num_groups : (i + 1) * num_groups]
                    if status is ok and any(
                        first != (want if slid else 0)
                        for first, slid in zip(lives, slides, strict=True)
                    ):
                        bad.add(seq.seq_id)
    for (seq, op), res in zip(plan.admits, admitted, strict=True):
        if res.status is not ok:
            continue
        cached = res.num_cached_tokens
        want = cached + min(op.num_prompt_tokens - cached, op.max_new_tokens)
        hits = cached // bs
        n = blocks_for_tokens(want, bs)
        if (
            cached % bs
            or not 0 <= cached < op.num_prompt_tokens
            or hits > len(op.block_hashes)
            or res.num_tokens != want
            or len(res.block_ids) != n * num_groups
        ):
            bad.add(seq.seq_id)
            continue
        window_start = first_live_block(cached, sliding_window, bs)
        for g, slides_g in enumerate(slides):
            ids = res.block_ids[g * n : (g + 1) * n]
            released = window_start if slides_g else 0
            if (
                any(b != NULL_BLOCK for b in ids[:released])
                or len(set(ids[released:])) != len(ids) - released
                or not all(0 < b < num_blocks for b in ids[released:hits])
                or not fresh(ids[max(hits, released) :])
            ):
                bad.add(seq.seq_id)
    if bad:
        raise BadAnswer("the block manager's answer contradicts the plan", bad)
