"""Embeddings through the gateway (``Embed``, ``/v1/embeddings``): one input's vector from a
pooling executor (``--runner pooling``), with the admission, validation, routing and
metrics a generation gets.

An input is tokenized (special tokens included, as the model was trained to embed it),
routed as a generation would be (LAST pooling reuses cached prefixes), and sent as one
``AddRequest`` with ``pooling`` set; its one update carries the vector. A lost executor
fails the input with UNAVAILABLE (it is cheap to retry: nothing was streamed)."""

from __future__ import annotations

import asyncio
import time
import uuid

from pagedserve.v1 import common_pb2, executor_pb2, generation_pb2
from services.common.limits import FieldError, check_prompt, check_request_id, field_of
from services.gateway.core.errors import NO_EXECUTOR, REFUSAL_KIND, ErrorKind, GenerationError
from services.gateway.core.generation import GenerationCore
from services.gateway.core.resume import Placement
from services.gateway.core.validation import check_prompt_bytes, check_runner
from services.gateway.fleet.executor_client import ExecutorUnavailable, Tagged

__all__ = ["EmbeddingService"]


class EmbeddingService:
    """``Embed`` over a :class:`GenerationCore`'s tokenizer, admission and executors."""

    def __init__(self, core: GenerationCore) -> None:
        self.core = core

    async def embed(self, request: generation_pb2.EmbedRequest) -> generation_pb2.EmbedResponse:
        """The vector of ``request``'s input; raises :class:`GenerationError`."""
        core = self.core
        core.enter()
        request_id = request.request_id or uuid.uuid4().hex
        try:
            add = await self._add_request(request, request_id)
            async with core.admission.running():
                return await self._run(add, request_id)
        finally:
            core.admission.leave()
            core.metrics.inflight.dec()

    async def _add_request(
        self, request: generation_pb2.EmbedRequest, request_id: str
    ) -> executor_pb2.AddRequest:
        core = self.core
        info = core.pool.info
        if info is None:
            core.metrics.requests.labels("unavailable").inc()
            raise GenerationError(ErrorKind.UNAVAILABLE, NO_EXECUTOR)
        try:
            check_runner(info.runner, "pooling")
            check_request_id(request_id)
            kind = request.WhichOneof("input")
            if kind == "text":
                check_prompt_bytes(kind, request.text, core.max_prompt_bytes(info.max_model_len))
                ids = await core.encode(request.text)
            elif kind == "token_ids":
                ids, kind = list(request.token_ids.ids), "token_ids.ids"
            elif kind == "pair":
                pair = request.pair
                limit = core.max_prompt_bytes(info.max_model_len)
                check_prompt_bytes("pair.query", pair.query, limit)
                check_prompt_bytes("pair.document", pair.document, limit)
                ids = await core.encode(pair.query, pair.document)
            else:
                raise FieldError("input", "one of text, token_ids or pair is required")
            check_prompt(ids, info.vocab_size, info.max_model_len, kind)
            if request.HasField("dimensions") and not 1 <= request.dimensions <= info.hidden_size:
                raise FieldError(
                    "dimensions",
                    f"must be in [1, {info.hidden_size}] (the model's hidden size), "
                    f"got {request.dimensions}",
                )
        except FieldError as exc:
            core.metrics.requests.labels("invalid").inc()
            raise GenerationError.invalid(exc) from None
        lora = request.lora_name
        if lora and not any(lora in c.adapters for c in core.pool.ready):
            core.metrics.requests.labels("invalid").inc()
            raise GenerationError(ErrorKind.NOT_FOUND, f"lora_name: no executor serves {lora!r}")
        pooling = executor_pb2.PoolingParams()
        if request.HasField("dimensions"):
            pooling.dimensions = request.dimensions
        if request.HasField("normalize"):
            pooling.normalize = request.normalize
        return executor_pb2.AddRequest(
            request_id=uuid.uuid4().hex,
            prompt_token_ids=ids,
            priority=request.priority,
            cache_salt=request.cache_salt.encode(),
            lora_name=lora,
            pooling=pooling,
        )

    async def _run(
        self, add: executor_pb2.AddRequest, request_id: str
    ) -> generation_pb2.EmbedResponse:
        core = self.core
        start = time.monotonic()
        queue: asyncio.Queue[Tagged] = asyncio.Queue()
        try:
            placement, _ = Placement.route(core.pool, [(add, [0])], queue, None)
        except ExecutorUnavailable as exc:
            core.metrics.requests.labels("unavailable").inc()
            raise GenerationError(ErrorKind.UNAVAILABLE, str(exc)) from None
        outcome = "cancelled"
        try:
            while True:
                _, item = await queue.get()
                if isinstance(item, BaseException):
                    outcome = "unavailable"
                    raise GenerationError(ErrorKind.UNAVAILABLE, str(item))
                if isinstance(item, executor_pb2.RequestError):
                    kind = REFUSAL_KIND.get(item.code, ErrorKind.INTERNAL)
                    outcome = "refused" if kind is not ErrorKind.INTERNAL else "error"
                    field = field_of(item.message) if kind is ErrorKind.INVALID_ARGUMENT else None
                    raise GenerationError(kind, item.message, field)
                if item.finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED:
                    continue  # (a pooling request has one update: its last)
                if not item.embedding:
                    outcome = "error"
                    raise GenerationError(
                        ErrorKind.INTERNAL, "the executor ended the request without a vector"
                    )
                outcome = "stop"
                core.metrics.prompt_tokens.inc(item.usage.prompt_tokens)
                core.metrics.cached_prompt_tokens.inc(item.usage.cached_prompt_tokens)
                core.metrics.e2e.observe(time.monotonic() - start)
                return generation_pb2.EmbedResponse(
                    request_id=request_id, embedding=item.embedding, usage=item.usage
                )
        finally:
            placement.release(abort=outcome != "stop")
            core.metrics.requests.labels(outcome).inc()
