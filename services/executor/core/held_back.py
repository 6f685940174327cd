"""Chunks held back while a tier fills their blocks (``SchedulerConfig.defer_filled_chunks``,
set when the runner's fills run beside the forward, as on CUDA).

A Step may grant a chunk whose tables hold blocks that the same Step's onboards or loads
fill. With the fills running beside this step's forward, that chunk must not read them yet:
it is held back, keeping the slots the pool granted it (``num_ahead_slots``), and the next
batch runs it with no operation of its own, once the engine has waited for the fills. The
rest of the batch never waits for a copy. :class:`HeldBackChunks` is held by
:class:`~.scheduler.Scheduler`."""

from __future__ import annotations

from services.blockmgr.api.types import StepResult
from services.executor.core.plan import ScheduledChunk, SchedulePlan, hold_back_filled
from services.executor.core.sequence import SeqStatus, Sequence

__all__ = ["HeldBackChunks"]


class HeldBackChunks:
    """The held-back chunks (``granted``: each sequence with its chunk's tokens, in order):
    planned first in the next step, run with its batch. ``enabled``: chunks are held back
    at all (else :meth:`hold_back` keeps every chunk)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.granted: list[tuple[Sequence, int]] = []
        self.num_held_back = 0  # chunks held back so far

    def running(self) -> list[tuple[Sequence, int]]:
        """The held-back chunks of sequences still running."""
        return [(s, k) for s, k in self.granted if s.status is SeqStatus.RUNNING]

    def plan(self, plan: SchedulePlan, scheduled: set[int]) -> int:
        """Put the held-back chunks of sequences still running into ``plan`` (their slots
        are held already: no grow) and their ids into ``scheduled``; returns their tokens,
        taken from the step's budget."""
        tokens = 0
        for seq, k in self.granted:
            if seq.status is SeqStatus.RUNNING:
                plan.granted.append((seq, k))
                scheduled.add(seq.seq_id)
                tokens += k
        return tokens

    def take(self, plan: SchedulePlan) -> list[tuple[Sequence, int]]:
        """The held-back chunks ``plan`` runs (of sequences still running); none is held now."""
        self.granted = []
        return [(s, k) for s, k in plan.granted if s.status is SeqStatus.RUNNING]

    def hold_back(self, chunks: list[ScheduledChunk], result: StepResult) -> list[ScheduledChunk]:
        """``chunks`` less those whose blocks ``result``'s fills write, now held back."""
        if not self.enabled:
            return chunks
        before = len(self.granted)
        chunks = hold_back_filled(chunks, result, self.granted)
        self.num_held_back += len(self.granted) - before
        return chunks
