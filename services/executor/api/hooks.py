"""The runner hook: a model runner whose every forward goes through a caller's function."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import Tensor

from services.executor.api.types import ForwardInfo, RunnerHook
from services.executor.model.forward_batch import PreparedForward, SeqChunk
from services.executor.model.runner import ModelRunner

__all__ = ["HookedRunner", "forward_info"]

_MAX_IN_FLIGHT = 4  # prepared forwards not launched yet (async scheduling holds one)


def forward_info(chunks: Sequence[SeqChunk]) -> ForwardInfo:
    """What a forward over ``chunks`` computes."""
    new = context = 0
    for c in chunks:
        n = len(c.token_ids)
        new += n
        context += c.num_computed_tokens + n
    return ForwardInfo(len(chunks), new, context)


class HookedRunner:
    """``runner`` with ``hook`` around the device half of each forward (``launch``: upload
    the batch and run the model), the host batch being built before it (``prepare``): the
    same part of the step whether the engine runs a forward at once (``execute``) or builds
    it ahead (async scheduling). Everything else is the runner's."""

    def __init__(self, runner: ModelRunner, hook: RunnerHook) -> None:
        self._runner = runner
        self._hook = hook
        self._prepared: dict[int, ForwardInfo] = {}  # id(prepared forward) -> its forward

    def execute(self, chunks: Sequence[SeqChunk]) -> Tensor:
        runner = self._runner
        prepared = runner.prepare(chunks)  # (ModelRunner.execute is launch(prepare(chunks)))
        return self._hook(forward_info(chunks), lambda: runner.launch(prepared))

    def prepare(self, chunks: Sequence[SeqChunk]) -> PreparedForward:
        prepared = self._runner.prepare(chunks)
        if len(self._prepared) >= _MAX_IN_FLIGHT:  # abandoned ones (a step that failed)
            self._prepared.clear()
        self._prepared[id(prepared)] = forward_info(chunks)
        return prepared

    def launch(self, prepared: PreparedForward) -> Tensor:
        info = self._prepared.pop(id(prepared), None)
        if info is None:  # (not prepared through this wrapper)
            n = prepared.num_chunks
            info = ForwardInfo(n, n, n)
        runner = self._runner
        return self._hook(info, lambda: runner.launch(prepared))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._runner, name)
