"""The engine's async-scheduling path (``--async-scheduling``): the next step's Step sent
while this step's forward runs, its answer applied before sampling, and its host batch
built while the device works. A part of :class:`~.engine.Engine`, kept apart because only
the async path uses it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import structlog
from torch import Tensor

from services.blockmgr.api.errors import BlockManagerError
from services.blockmgr.api.protocol import StepCall
from services.executor.core.ahead import with_drafts
from services.executor.core.blockmgr_link import RECOVERABLE, BlockManagerLink
from services.executor.core.plan import BadAnswer, ScheduledBatch, SchedulePlan
from services.executor.core.runner import PreparingRunner, seq_chunks
from services.executor.core.sequence import SeqStatus
from services.executor.model.forward_batch import PreparedForward

if TYPE_CHECKING:
    from services.executor.core.config import EngineSettings
    from services.executor.core.plan import ScheduledChunk
    from services.executor.core.runner import Runner
    from services.executor.core.scheduler import Scheduler
    from services.executor.core.spec.decoding import Speculation

__all__ = ["AheadEngine", "PreparedBatch"]

log = structlog.get_logger(__name__)


@dataclass
class PreparedBatch:
    """The next step's batch, built on the host before this step's sampling: the tokens this
    step samples (``pending`` chunks) are written in before it runs."""

    forward: PreparedForward
    chunks: list[ScheduledChunk]  # as built; some may have ended by launch
    pending: list[int]  # chunks whose (one) token is the one sampled in this step
    # At launch: the logits rows of the chunks still running, None if all are.
    rows: list[int] | None = None


class AheadEngine:
    """The async path of :class:`~.engine.Engine`, over its state."""

    if TYPE_CHECKING:  # provided by Engine
        settings: EngineSettings
        link: BlockManagerLink
        scheduler: Scheduler
        runner: Runner
        num_steps_ahead: int
        num_ahead_failures: int
        num_batches_prepared: int
        _batch_ahead: ScheduledBatch | None
        _prepared: PreparedBatch | None
        _preparing: PreparingRunner | None
        _num_prompt_logprobs: int
        _num_beam_requests: int
        spec: Speculation | None
        _fills_async: bool

        def _take_failed_moves(self, *, wait: bool = False) -> set[int]: ...
        def _move_blocks(self, batch: ScheduledBatch) -> None: ...

    def _take_batch_ahead(self) -> tuple[ScheduledBatch | None, PreparedBatch | None]:
        """The batch granted during the previous step, less the sequences that finished since
        (their slots go back with the next Step), and its host batch if one was prepared,
        completed: the tokens sampled since written in, the ended sequences' rows made to
        write nothing. (None, None) when nothing of it is left."""
        batch, self._batch_ahead = self._batch_ahead, None
        prepared, self._prepared = self._prepared, None
        if batch is None:
            return None, None
        running = SeqStatus.RUNNING
        chunks = [c for c in batch.chunks if c.seq.status is running]
        if self.spec is not None:  # (never prepared: its drafts are known now)
            chunks = with_drafts(chunks)
        if not chunks:
            if batch.has_moves:  # the pool's host tier counts on them, batch or not
                self._move_blocks(batch)
            return None, None
        self.num_steps_ahead += 1
        if prepared is not None:
            host, built = prepared.forward.host, prepared.chunks
            live = [i for i in prepared.pending if built[i].seq.status is running]
            host.set_last_tokens(live, [built[i].seq.token_ids[-1] for i in live])
            if len(chunks) < len(built):
                prepared.rows, row = [], 0
                for i, c in enumerate(built):
                    alive = c.seq.status is running
                    if not alive:
                        host.write_nothing(i)
                    if c.need_logits:
                        if alive:
                            prepared.rows.append(row)
                        row += 1
        return ScheduledBatch(chunks, batch.copies, *batch.moves), prepared

    def _prepare(self, batch: ScheduledBatch) -> PreparedBatch:
        """Build ``batch``'s host batch now, before this step's sampling: a chunk of a
        sequence sampled in this step gets a placeholder for that token."""
        assert self._preparing is not None
        chunks, pending = seq_chunks(batch)
        return PreparedBatch(self._preparing.prepare(chunks), batch.chunks, pending)

    def _launch(self, prepared: PreparedBatch) -> tuple[Tensor, list[int] | None]:
        """Run a prepared batch: its logits, and the rows of the sequences still running
        (None: every row), selected only when sampling (an index built now would wait for
        the device here, before the work meant to overlap it)."""
        assert self._preparing is not None
        self.num_batches_prepared += 1
        return self._preparing.launch(prepared.forward), prepared.rows

    def _send_ahead(self, batch: ScheduledBatch) -> tuple[SchedulePlan, StepCall] | None:
        """Plan the next step now and send its Step, if that is safe."""
        if not self.settings.async_scheduling or not self.link.can_send_ahead:
            return None
        if self._fills_async and self.runner.filling:  # type: ignore[attr-defined]
            # The Step must report the failed ones (none is this batch's: held back).
            self._take_failed_moves(wait=True)
        if self._num_beam_requests:
            return None  # beams re-fork after sampling
        # (Only while a request asks for prompt log-probabilities need it look for one.)
        plan = self.scheduler.plan_ahead(batch, bool(self._num_prompt_logprobs))
        if plan is None:
            return None
        return plan, self.link.send_ahead(plan.ops())

    def _receive_ahead(
        self, plan: SchedulePlan, call: StepCall
    ) -> tuple[SchedulePlan, BadAnswer] | None:
        """Apply the answer to the Step sent ahead: the next step's batch. A call that failed
        with a recoverable error abandons the plan: the pool is rebuilt before the next Step,
        which is then planned after sampling (other errors are raised, as a Step's are). A
        contradicting answer is returned, for :meth:`_distrust` after sampling."""
        try:
            self._batch_ahead = self.scheduler.apply_ahead(plan, call.result())
        except BlockManagerError as exc:
            if exc.code not in RECOVERABLE:
                raise
            log.warning("blockmgr_step_ahead_failed", code=exc.code.name, error=exc.message)
            self.num_ahead_failures += 1
            self.scheduler.abandon(plan)
            self.link.invalidate()
        except BadAnswer as exc:
            self.num_ahead_failures += 1
            return plan, exc
        return None
