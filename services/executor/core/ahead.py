"""Async scheduling: the next step planned before this step's forward, so that its
block-manager round trip overlaps the forward (``--async-scheduling``). The scheduler's
:meth:`~.scheduler.Scheduler.plan_ahead` and :meth:`~.scheduler.Scheduler.apply_ahead` are
built on these functions, kept apart because only the async path uses them; they own no
state."""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass, field

from services.common.blocks import blocks_to_grow, needs_cow
from services.executor.core.plan import ScheduledBatch, ScheduledChunk
from services.executor.core.sequence import Sequence

__all__ = ["AheadGrows", "ahead_chunks", "next_grows"]


@dataclass
class AheadGrows:
    """The grows of the next step, as :func:`next_grows` plans them."""

    grows: list[tuple[Sequence, int]] = field(default_factory=list)  # decodes, then prefills
    grow_blocks: list[int] = field(default_factory=list)  # new blocks each grow must get
    held: list[int] = field(default_factory=list)  # slots each one holds after the forward
    budget: int = 0  # the tokens left for admissions


def next_grows(
    batch: ScheduledBatch,
    running: list[Sequence],
    granted: list[tuple[Sequence, int]],
    refs: Counter[int],
    *,
    block_size: int,
    max_num_batched_tokens: int,
) -> AheadGrows | None:
    """The ``running`` sequences' grows in the step after ``batch``, as
    :meth:`~.scheduler.Scheduler.plan` would plan them once ``batch`` has run and been
    sampled: a sequence that samples a token now grows by that token's slot, whatever the
    token turns out to be (one whose token is its last by ``max_tokens`` is left out), then
    prefill chunks go on within the token budget, less the ``granted`` (held-back) chunks'
    tokens. ``refs``: the refcount mirror. None when the next step must be planned after
    sampling: samples about to fork, or a copy-on-write."""
    scheduled = {c.seq.seq_id: c for c in batch.chunks}
    held_back = {s.seq_id for s, _ in granted}  # they run next with the slots they hold
    decodes: list[tuple[Sequence, int]] = []  # (seq, slots it holds after this forward)
    prefills: list[tuple[Sequence, int, int]] = []  # (seq, slots, tokens left)
    for seq in running:
        if held_back and seq.seq_id in held_back:
            continue
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
    bs = block_size
    budget = max_num_batched_tokens - sum(k for _, k in granted)
    ahead = AheadGrows()
    grows, grow_blocks, held = ahead.grows, ahead.grow_blocks, ahead.held
    for seq, slots, left in itertools.chain(((s, n, 1) for s, n in decodes), prefills):
        if budget <= 0:
            break
        k = min(left, budget)
        tables = seq.tables
        if tables[0] and any(needs_cow(slots, k, bs, refs[t[-1]]) for t in tables):
            return None  # planned after sampling
        grows.append((seq, k))
        grow_blocks.append(blocks_to_grow(slots, k, len(tables[0]), bs) * len(tables))
        held.append(slots)
        budget -= k
    ahead.budget = budget
    return ahead


def ahead_chunks(
    grows: list[tuple[Sequence, int]],
    failed: set[int],
    granted: list[tuple[Sequence, int]],
    admitted: list[tuple[Sequence, int]],
) -> list[ScheduledChunk]:
    """The next step's chunks, granted ahead: the ``grows`` (less the ``failed`` ones), the
    ``granted`` (held-back) chunks, then the first chunks of the ``admitted`` sequences.
    Until that batch runs, ``num_ahead_slots`` counts the slots granted ahead."""
    chunks: list[ScheduledChunk] = []
    append, new = chunks.append, tuple.__new__  # hot: every sequence, every step
    for seq, k in grows:
        if failed and seq.seq_id in failed:
            continue
        seq.num_ahead_slots = k
        # A sequence sampled in this step lacks its token yet: its chunk samples too.
        end = seq.num_computed_tokens + k
        append(new(ScheduledChunk, (seq, k, end >= len(seq.token_ids))))
    for seq, k in granted:  # (their num_ahead_slots are k already)
        append(ScheduledChunk(seq, k, seq.num_computed_tokens + k == len(seq.token_ids)))
    for seq, k in admitted:
        seq.num_ahead_slots = k
        append(ScheduledChunk(seq, k, seq.num_computed_tokens + k == len(seq.token_ids)))
    return chunks
