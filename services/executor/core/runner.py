"""What the engine needs from the model side: the runner's contract (``ModelRunner``
satisfies it; tests use fakes), and the chunks it computes for a scheduled batch."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor

from services.executor.core.plan import ScheduledBatch
from services.executor.model.forward_batch import PreparedForward, SeqChunk

__all__ = ["PreparingRunner", "Runner", "seq_chunks"]


class Runner(Protocol):
    """What the engine needs from a model runner (``ModelRunner``, or a fake in tests).

    Optional: ``launch_returns_early`` (default: the device is CUDA), whether a forward
    returns once launched, before the device is done; async scheduling then plans the next
    step after the launch, in the device's time, rather than before it. ``fills_async``
    (default False) with ``wait_fills()``: :meth:`move_blocks` returns with its fills (onboards
    and loads) still running; the engine then holds back the chunks that read their blocks
    and calls ``wait_fills`` before the next step's moves, copies and forward."""

    device: torch.device
    num_blocks: int

    def execute(self, chunks: Sequence[SeqChunk]) -> Tensor: ...
    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None: ...
    def move_blocks(
        self,
        offloads: Sequence[tuple[int, int]],
        onboards: Sequence[tuple[int, int]],
        spills: Sequence[tuple[int, int]] = (),
        loads: Sequence[tuple[int, int]] = (),
        stores: Sequence[tuple[int, int]] = (),
    ) -> None:
        """The tiers' moves of a Step, in this order: spills ``(host slot, disk slot)``,
        offloads (device to host) ``(device block, host slot)``, stores (device to disk)
        ``(device block, disk slot)``, onboards (host to device) ``(device block, host
        slot)``, loads ``(disk slot, device block)``."""
        ...


@runtime_checkable
class PreparingRunner(Protocol):
    """A runner whose ``execute`` comes in two halves (``ModelRunner``): with async
    scheduling the next step's host batch is built while the device runs this step."""

    def prepare(self, chunks: Sequence[SeqChunk]) -> PreparedForward: ...
    def launch(self, prepared: PreparedForward) -> Tensor: ...


def seq_chunks(batch: ScheduledBatch) -> tuple[list[SeqChunk], list[int]]:
    """What the runner computes for ``batch``, and the chunks whose token is not known yet
    (a batch built ahead: the one token its sequence samples in this step), which get a
    placeholder."""
    seq_chunks: list[SeqChunk] = []
    pending: list[int] = []
    append, new = seq_chunks.append, tuple.__new__  # hot: 256 decode chunks per step
    for i, (seq, k, need_logits) in enumerate(batch.chunks):
        start = seq.num_computed_tokens
        drafts = seq.num_scheduled_drafts
        if drafts:  # its last token and its drafts: every row is verified
            tokens = [*seq.token_ids[start : start + k - drafts], *seq.draft_token_ids[:drafts]]
            every = True
        else:
            tokens = seq.token_ids[start : start + k]
            if len(tokens) < k:  # k == 1
                pending.append(i)
                tokens = [0]
            every = start < seq.prompt_len and seq.wants_prompt_logprobs()
        tables = seq.tables
        group_tables = tuple(tables) if len(tables) > 1 else ()
        chunk = (tokens, start, tables[0], need_logits, every, group_tables, seq.lora_id)
        append(new(SeqChunk, chunk))
    return seq_chunks, pending
