"""The public ``pagedserve.v1.Generation`` service: validation, tokenization, admission,
routing, and streaming of each sample's text."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

import grpc
import structlog
from transformers import PreTrainedTokenizerBase

from pagedserve.v1 import common_pb2, executor_pb2, generation_pb2, generation_pb2_grpc
from services.common.limits import FieldError, check_prompt, check_request_id, check_token_ids
from services.gateway.config import GatewayConfig
from services.gateway.executor_client import ExecutorPool, ExecutorUnavailable
from services.gateway.metrics import GatewayMetrics
from services.gateway.sample_stream import SampleStream
from services.gateway.validation import (
    Limits,
    check_input_kind,
    check_messages,
    sampling_to_executor,
)

log = structlog.get_logger(__name__)

_REFUSAL_STATUS = {
    executor_pb2.REQUEST_ERROR_CODE_INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT,
    executor_pb2.REQUEST_ERROR_CODE_ALREADY_EXISTS: grpc.StatusCode.ALREADY_EXISTS,
    executor_pb2.REQUEST_ERROR_CODE_RESOURCE_EXHAUSTED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    executor_pb2.REQUEST_ERROR_CODE_INTERNAL: grpc.StatusCode.INTERNAL,
}
_FINISH_NAMES = {
    common_pb2.FINISH_REASON_STOP: "stop",
    common_pb2.FINISH_REASON_LENGTH: "length",
    common_pb2.FINISH_REASON_ABORT: "abort",
}


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    def __init__(
        self,
        config: GatewayConfig,
        tokenizer: PreTrainedTokenizerBase,
        pool: ExecutorPool,
        metrics: GatewayMetrics,
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.pool = pool
        self.metrics = metrics
        self.model_name = config.served_model_name or config.model.rstrip("/").split("/")[-1]
        self.num_inflight = 0

    # ---- Generate ---------------------------------------------------------------------------

    async def Generate(
        self, request: generation_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[generation_pb2.GenerateResponse]:
        if self.num_inflight >= self.config.max_concurrent_requests:
            self.metrics.requests.labels("rejected_full").inc()
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"the gateway is at max_concurrent_requests="
                f"{self.config.max_concurrent_requests}; retry later",
            )
        self.num_inflight += 1
        self.metrics.inflight.inc()
        request_id = request.request_id or uuid.uuid4().hex
        structlog.contextvars.bind_contextvars(request_id=request_id)
        try:
            async for response in self._generate(request, request_id, context):
                yield response
        finally:
            self.num_inflight -= 1
            self.metrics.inflight.dec()
            structlog.contextvars.unbind_contextvars("request_id")

    async def _generate(
        self,
        request: generation_pb2.GenerateRequest,
        request_id: str,
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[generation_pb2.GenerateResponse]:
        start = time.monotonic()
        info = self.pool.info
        if info is None:
            self.metrics.requests.labels("unavailable").inc()
            await context.abort(grpc.StatusCode.UNAVAILABLE, "no executor is ready")
        assert info is not None
        limits = Limits(info.max_model_len, info.vocab_size, self.config.max_n)
        try:
            check_request_id(request_id)
            prompt_ids = self._prompt_ids(request, limits)
            params, options = sampling_to_executor(request, len(prompt_ids), limits)
        except FieldError as exc:
            self.metrics.requests.labels("invalid").inc()
            log.info("request_invalid", error=str(exc))
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        samples = [
            SampleStream(request_id, i, self.tokenizer, prompt_ids, options)
            for i in range(params.n)
        ]
        try:
            conn = self.pool.pick()
            internal_id = uuid.uuid4().hex
            queue = conn.submit(
                executor_pb2.AddRequest(
                    request_id=internal_id,
                    prompt_token_ids=prompt_ids,
                    sampling_params=params,
                    priority=request.priority,
                    cache_salt=request.cache_salt.encode(),
                )
            )
        except ExecutorUnavailable as exc:
            self.metrics.requests.labels("unavailable").inc()
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        log.info(
            "request_accepted",
            executor=conn.address,
            num_prompt_tokens=len(prompt_ids),
            n=params.n,
            max_tokens=params.max_tokens,
        )

        last_token_at: list[float | None] = [None] * params.n
        done = 0
        completed = False
        stopped_here = False  # a stop string ended a sample the executor may still be running
        try:
            while done < params.n:
                item = await queue.get()
                if isinstance(item, executor_pb2.RequestError):
                    code = _REFUSAL_STATUS.get(item.code, grpc.StatusCode.INTERNAL)
                    self.metrics.requests.labels("refused").inc()
                    await context.abort(code, item.message)
                if isinstance(item, BaseException):
                    self.metrics.requests.labels("unavailable").inc()
                    log.warning("executor_lost_mid_request", error=str(item))
                    await context.abort(grpc.StatusCode.UNAVAILABLE, str(item))
                assert isinstance(item, executor_pb2.SequenceUpdate)
                sample = samples[item.index]
                response, stopped = sample.process(item)
                if stopped:
                    stopped_here = True
                    if params.n > 1 and done + 1 < params.n:
                        conn.abort_sample(internal_id, item.index)
                if response is None:
                    continue
                now = time.monotonic()
                if response.token_ids:
                    prev = last_token_at[item.index]
                    if prev is None:
                        if item.index == 0:
                            self.metrics.ttft.observe(now - start)
                    else:
                        self.metrics.itl.observe(now - prev)
                    last_token_at[item.index] = now
                    self.metrics.generation_tokens.inc(len(response.token_ids))
                if response.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
                    done += 1
                    self._record_final(response)
                yield response
            completed = True
            self.metrics.e2e.observe(time.monotonic() - start)
            log.info(
                "request_finished",
                latency_s=round(time.monotonic() - start, 4),
                completion_tokens=[s.num_tokens for s in samples],
            )
        finally:
            # Cancelled, deadline passed, or failed: stop it on the executor right away.
            conn.release(internal_id, abort=not completed or stopped_here)
            if not completed:
                self.metrics.requests.labels("cancelled").inc()
                log.info("request_cancelled", after_s=round(time.monotonic() - start, 4))

    def _record_final(self, response: generation_pb2.GenerateResponse) -> None:
        self.metrics.requests.labels(_FINISH_NAMES.get(response.finish_reason, "other")).inc()
        if response.index == 0:
            self.metrics.prompt_tokens.inc(response.usage.prompt_tokens)
            self.metrics.cached_prompt_tokens.inc(response.usage.cached_prompt_tokens)

    def _prompt_ids(self, request: generation_pb2.GenerateRequest, limits: Limits) -> list[int]:
        kind = check_input_kind(request)
        field = kind
        if kind == "prompt":
            ids = self.tokenizer(request.prompt).input_ids
        elif kind == "prompt_token_ids":
            ids = list(request.prompt_token_ids.ids)
            field = "prompt_token_ids.ids"
        else:
            ids = self._chat_ids(request.messages, "messages")
        check_prompt(ids, limits.vocab_size, limits.max_model_len, field)
        return ids

    def _chat_ids(self, messages: generation_pb2.ChatMessages, field: str) -> list[int]:
        check_messages(messages, field)
        if not getattr(self.tokenizer, "chat_template", None):
            raise FieldError(field, "the model has no chat template")
        add_prompt = (
            messages.add_generation_prompt if messages.HasField("add_generation_prompt") else True
        )
        text = self.tokenizer.apply_chat_template(
            [{"role": m.role, "content": m.content} for m in messages.messages],
            add_generation_prompt=add_prompt,
            tokenize=False,
        )
        # The template writes its own special tokens (BOS): tokenize without adding more.
        return self.tokenizer(text, add_special_tokens=False).input_ids

    # ---- the rest of the API ----------------------------------------------------------------

    async def Tokenize(
        self, request: generation_pb2.TokenizeRequest, context: grpc.aio.ServicerContext
    ) -> generation_pb2.TokenizeResponse:
        kind = request.WhichOneof("input")
        try:
            if kind == "text":
                add = request.add_special_tokens if request.HasField("add_special_tokens") else True
                ids = self.tokenizer(request.text, add_special_tokens=add).input_ids
            elif kind == "messages":
                ids = self._chat_ids(request.messages, "messages")
            else:
                raise FieldError("input", "one of text or messages is required")
        except FieldError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        tokens = self.tokenizer.convert_ids_to_tokens(ids)
        return generation_pb2.TokenizeResponse(token_ids=ids, tokens=tokens)

    async def Detokenize(
        self, request: generation_pb2.DetokenizeRequest, context: grpc.aio.ServicerContext
    ) -> generation_pb2.DetokenizeResponse:
        try:
            check_token_ids(list(request.token_ids), len(self.tokenizer), "token_ids")
        except FieldError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        skip = request.skip_special_tokens if request.HasField("skip_special_tokens") else True
        text = self.tokenizer.decode(list(request.token_ids), skip_special_tokens=skip)
        return generation_pb2.DetokenizeResponse(text=text)

    async def GetModelInfo(
        self, request: generation_pb2.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> generation_pb2.ModelInfo:
        ready = self.pool.ready
        if not ready:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "no executor is ready")
        info = ready[0].info
        assert info is not None
        return generation_pb2.ModelInfo(
            model_name=self.model_name,
            max_model_len=info.max_model_len,
            vocab_size=info.vocab_size,
            block_size=info.block_size,
            kv_capacity_tokens=sum(c.info.kv_capacity_tokens for c in ready if c.info),
            num_kv_blocks=sum(c.info.num_kv_blocks for c in ready if c.info),
            dtype=info.dtype,
            max_n=self.config.max_n,
            eos_token_ids=info.eos_token_ids,
            num_executors=len(ready),
        )
