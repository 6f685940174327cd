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
from services.executor.core.config import SchedulerConfig
from services.executor.core.plan import ScheduledBatch, ScheduledChunk, SchedulePlan, grant
from services.executor.core.sequence import Sequence

__all__ = ["AheadGrows", "ahead_chunks", "next_grows", "with_drafts"]


@dataclass
class AheadGrows:
    """The grows of the next step, as :func:`next_grows` plans them."""

    grows: list[tuple[Sequence, int]] = field(default_factory=list)  # decodes, then prefills
    grow_blocks: list[int] = field(default_factory=list)  # new blocks each grow must get
    held: list[int] = field(default_factory=list)  # the pool's tokens before each grow
    # Speculative decoding: each grow's (verified tokens, lookahead slots, accepted drafts it
    # reports), as the Grow carries them (empty when speculation is off).
    counts: list[tuple[int, int, int]] = field(default_factory=list)
    budget: int = 0  # the tokens left for admissions
    num_finishing: int = 0  # running sequences whose token sampled now is their last


def next_grows(
    batch: ScheduledBatch,
    running: list[Sequence],
    granted: list[tuple[Sequence, int]],
    refs: Counter[int],
    config: SchedulerConfig,
) -> AheadGrows | None:
    """The ``running`` sequences' grows in the step after ``batch``, as
    :meth:`~.scheduler.Scheduler.plan` would plan them once ``batch`` has run and been
    sampled: a sequence that samples a token now grows by that token's slot, whatever the
    token turns out to be (one whose token is its last by ``max_tokens`` is left out), then
    prefill chunks go on within the token budget (``config``'s), less the ``granted``
    (held-back) chunks' tokens. ``refs``: the refcount mirror. None when the next step must
    be planned after sampling: samples about to fork, or a copy-on-write.

    With speculative decoding (``config.num_speculative_tokens`` k > 0) it takes the worst
    case, as drafts are made after sampling: a decode's grow computes its token and up to
    ``L <= k`` drafts (from the budget left once every decode has its token, no more than it
    may still output, none in a batch of ``spec_disable_by_batch_size`` sequences; its chunk
    is cut to the drafts made, once they are: :func:`with_drafts`), and holds slots for this
    step's drafts all accepted and L more. Its verified tokens are those the pool is sure
    of: the token after this step's first (the one sampled, or the first draft accepted) and
    the accepted drafts already known; the ones this step accepts are reported by a later
    grow. A decode whose writes may reach a block another table holds is planned after
    sampling (no copy-on-write)."""
    scheduled = {c.seq.seq_id: c for c in batch.chunks}
    held_back = {s.seq_id for s, _ in granted}  # they run next with the slots they hold
    # (seq, slots it holds after this forward, the pool's tokens then, tokens left)
    decodes: list[tuple[Sequence, int, int, int]] = []
    num_finishing = 0
    prefills: list[tuple[Sequence, int, int, int]] = []
    for seq in running:
        if held_back and seq.seq_id in held_back:
            continue
        chunk = scheduled.get(seq.seq_id)
        slots = seq.num_computed_tokens
        if chunk is None:
            left = len(seq.token_ids) - slots
        elif chunk.need_logits:  # samples a token now
            slots += chunk.num_new_tokens
            # (its drafts may all be rejected: it outputs this many tokens at least)
            num_output = slots - seq.num_scheduled_drafts + 1 - seq.prompt_len
            if num_output == 1 and seq.params.n > 1:
                return None  # its other samples fork from this token
            if num_output >= seq.params.max_tokens:
                num_finishing += 1  # this token is its last: nothing to grow, its seat frees
                continue
            left = 1
        else:
            slots += chunk.num_new_tokens
            left = len(seq.token_ids) - slots
        # The pool's tokens once this step's grow is applied: its verified ones.
        pool = slots - seq.num_scheduled_drafts - seq.num_unreported
        if left == 1:
            decodes.append((seq, slots, pool, 1))
        else:
            prefills.append((seq, slots, pool, left))
    bs, k_max, cap = (
        config.block_size,
        config.num_speculative_tokens,
        config.spec_disable_by_batch_size,
    )
    speculative = config.speculative
    if cap and len(running) - num_finishing >= cap:
        k_max = 0  # (off for the batch: no drafts to hold room for, but this step's)
    budget = config.max_num_batched_tokens - sum(k for _, k in granted)
    spare = budget - len(decodes)  # the tokens for drafts, once every decode has its own
    ahead = AheadGrows()
    grows, grow_blocks, held, counts = ahead.grows, ahead.grow_blocks, ahead.held, ahead.counts
    for seq, slots, pool, left in itertools.chain(decodes, prefills):
        if budget <= 0:
            break
        k = min(left, budget)
        tables = seq.tables
        if speculative:  # (every grow reports its counts, drafts planned or not)
            drafts = 0
            if left == 1:  # the worst case, within what it may still output
                room = seq.params.max_tokens - (pool + 1 - seq.prompt_len) - 1
                drafts = max(0, min(k_max, spare, room))
                k += drafts
                spare -= drafts
            if tables[0] and any(refs[b] != 1 for t in tables for b in t[pool // bs :]):
                return None  # its writes may reach a shared block: planned after sampling
            u = seq.num_unreported
            counts.append((k - drafts + u, seq.num_scheduled_drafts + drafts, u))
        elif tables[0] and any(needs_cow(slots, k, bs, refs[t[-1]]) for t in tables):
            return None  # planned after sampling
        grows.append((seq, k))
        grow_blocks.append(blocks_to_grow(slots, k, len(tables[0]), bs) * len(tables))
        held.append(pool)
        budget -= k
    ahead.budget, ahead.num_finishing = budget, num_finishing
    return ahead


def ahead_chunks(
    plan: SchedulePlan,
    failed: set[int],
    granted: list[tuple[Sequence, int]],
    admitted: list[tuple[Sequence, int]],
) -> list[ScheduledChunk]:
    """The next step's chunks, granted ahead: ``plan``'s grows (less the ``failed`` ones), the
    ``granted`` (held-back) chunks, then the first chunks of the ``admitted`` sequences.
    Until that batch runs, ``num_ahead_slots`` counts the tokens the pool counted ahead.
    With speculative decoding (the plan's ``ahead_counts``, as :func:`next_grows` made them),
    a granted grow also holds its lookahead slots, and the accepted drafts it reported are
    counted."""
    chunks: list[ScheduledChunk] = []
    append, new = chunks.append, tuple.__new__  # hot: every sequence, every step
    counts = plan.ahead_counts
    for i, (seq, k) in enumerate(plan.grows):
        if failed and seq.seq_id in failed:
            continue
        if counts:
            n, lookahead, reported = counts[i]
            grant(seq, n, lookahead, reported)
            seq.num_ahead_slots = n - reported
        else:
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


def with_drafts(chunks: list[ScheduledChunk]) -> list[ScheduledChunk]:
    """The chunks of a batch granted ahead with speculative decoding, once this step's drafts
    are proposed: a decode granted ``1 + L`` tokens (:func:`next_grows`) computes its token
    and ``min(its planned drafts, L)`` drafts; the other chunks are as granted."""
    out: list[ScheduledChunk] = []
    for chunk in chunks:
        seq, k = chunk.seq, chunk.num_new_tokens
        if k > 1 and len(seq.token_ids) - seq.num_computed_tokens == 1:
            drafts = min(seq.num_planned_drafts, k - 1)
            seq.num_scheduled_drafts = drafts
            chunk = ScheduledChunk(seq, 1 + drafts, True)
        out.append(chunk)
    return out
