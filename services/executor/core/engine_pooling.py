"""The engine of ``--runner pooling``: every request's prompt is computed once, its pooled
vector returned on its one output, and its blocks freed by the next Step (core.pooling).

It schedules, preempts and shares prefix blocks as the generating engine does; only what
follows the forward differs: no sampling, no speculation, no planning ahead (a request
ends where a generating one would sample)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import Tensor

from services.common.sampling_params import SamplingParams
from services.executor.core.blockmgr_link import BlockManagerLink
from services.executor.core.config import EngineSettings
from services.executor.core.engine import Engine
from services.executor.core.grammar import GrammarCompiler
from services.executor.core.lora import LoRARegistry
from services.executor.core.outputs import EngineError, RequestErrorCode, SeqOutput
from services.executor.core.plan import ScheduledBatch, SchedulePlan
from services.executor.core.pooling import (
    Classifier,
    PoolerConfig,
    PoolingParams,
    PoolState,
    finish,
    take_pooled,
    wrong_runner,
)
from services.executor.core.runner import Runner, seq_chunks
from services.executor.core.sequence import FinishReason, RequestKey
from services.executor.core.sequence import Sequence as Seq

__all__ = ["PoolingEngine"]

_NO_SAMPLING = SamplingParams(max_tokens=1, temperature=0.0)


class PoolingEngine(Engine):
    def __init__(
        self,
        settings: EngineSettings,
        runner: Runner,
        link: BlockManagerLink,
        pooler: PoolerConfig,
        hidden_size: int,
        grammars: GrammarCompiler | None = None,
        adapters: LoRARegistry | None = None,
        classifier: Classifier | None = None,
    ) -> None:
        """``classifier``: scores instead of vectors (a reranker's ``classifier_from_token``
        rows of the LM head, or a sequence classifier's score head)."""
        if settings.speculative_config is not None:
            raise ValueError("--speculative-config: a pooling runner samples nothing to draft")
        super().__init__(settings, runner, link, grammars, adapters)
        self.pooler = pooler
        self.hidden_size = hidden_size
        self.classifier = classifier
        if pooler.classifier_from_token and (classifier is None or not classifier.pair):
            raise ValueError("classifier_from_token: the LM head's rows of those tokens")

    def add_request(
        self,
        req_id: RequestKey,
        prompt_token_ids: Sequence[int],
        params: SamplingParams | None = None,
        *,
        pooling: PoolingParams | None = None,
        **kwargs: Any,
    ) -> None:
        """Queue a pooling request (``pooling`` set; ``params`` and ``resume`` must not
        be); raises :class:`EngineError` (nothing queued) if it is refused."""
        if pooling is None or params is not None:
            raise wrong_runner("pooling", "sampling_params")
        if kwargs.get("resume") is not None:
            raise EngineError(
                RequestErrorCode.INVALID_ARGUMENT, "resume: a pooling request has no output"
            )
        dims = pooling.dimensions
        if dims is not None and self.classifier is not None:
            raise EngineError(
                RequestErrorCode.INVALID_ARGUMENT,
                "pooling.dimensions: this executor scores (a classifier: its labels' values, "
                "not a vector)",
            )
        if dims is not None and not 1 <= dims <= self.hidden_size:
            raise EngineError(
                RequestErrorCode.INVALID_ARGUMENT,
                f"pooling.dimensions: must be in [1, {self.hidden_size}] (the model's hidden "
                f"size), got {dims}",
            )
        super().add_request(req_id, prompt_token_ids, _NO_SAMPLING, **kwargs)
        self.requests[req_id].seqs[0].pooled = PoolState(pooling)

    def _send_ahead(self, batch: ScheduledBatch) -> tuple[SchedulePlan, Any] | None:
        return None  # a request ends where one planned ahead would get its next slot

    def _forward(self, batch: ScheduledBatch) -> Tensor:
        chunks, pending = seq_chunks(batch)
        assert not pending
        if self.pooler.every_row:
            chunks = [c._replace(all_logits=True) for c in chunks]
        return self.runner.execute(chunks)

    def _take_prompt_rows(self, batch: ScheduledBatch, logits: Tensor) -> Tensor:
        return take_pooled(batch, logits, self.pooler)  # (hidden states, not logits)

    def _sample_and_update(
        self, logits: Tensor, seqs: list[Seq], rows: list[int] | None = None
    ) -> list[SeqOutput]:
        """Each of ``seqs`` computed its whole prompt: its vector, and its end."""
        assert rows is None and len(seqs) == logits.shape[0]
        states = [seq.pooled for seq in seqs]
        vectors = finish(logits, states, self.pooler, self.classifier)
        outs: list[SeqOutput] = []
        for seq, vector in zip(seqs, vectors, strict=True):
            out = SeqOutput(seq.req_id, seq.index, embedding=vector)
            outs.append(self._retire(seq, FinishReason.STOP, out=out))
        return outs
