"""The gateway's one generation core, behind both public fronts (gRPC and OpenAI HTTP).

It owns admission (``--max-concurrent-requests`` sent to executors, up to
``--max-queued-requests`` more waiting here, then refusal; see ``admission``), validation,
tokenization and the chat template (off the event loop), routing to an executor, and turning
each sample's token updates into text (incremental detokenization, stop strings, finish
reasons, usage, metrics). A front translates its request into a ``GenerateRequest``, iterates
:meth:`GenerationCore.generate`, and maps a :class:`GenerationError` to its own status (gRPC
code, HTTP status + OpenAI error JSON). Cancelling the iteration or closing it early (client
gone, deadline) aborts the request on its executor and frees its slot at once; a front must
close the generator (``contextlib.aclosing``) rather than leave it to the garbage collector.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncGenerator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar, cast

import structlog
from transformers import PreTrainedTokenizerBase

from pagedserve.v1 import common_pb2, executor_pb2, generation_pb2
from services.common.limits import (
    FieldError,
    check_prompt,
    check_request_id,
    check_token_ids,
    field_of,
)
from services.gateway.core.admission import Admission
from services.gateway.core.errors import (
    NO_EXECUTOR,
    REFUSAL_KIND,
    ErrorKind,
    GenerationError,
)
from services.gateway.core.metrics import GatewayMetrics
from services.gateway.core.resume import (
    Placement,
    executors_for,
    place_again,
    resume_adds,
    unavailable_message,
)
from services.gateway.core.sample_stream import SampleStream
from services.gateway.core.settings import PROMPT_BYTES_PER_TOKEN, GenerationSettings
from services.gateway.core.validation import (
    DEFAULT_MAX_TOKENS,
    Limits,
    check_input_kind,
    check_messages,
    check_prompt_bytes,
    check_runner,
    sampling_to_executor,
)
from services.gateway.fleet.executor_client import (
    ExecutorConnection,
    ExecutorPool,
    ExecutorUnavailable,
    Tagged,
)
from services.gateway.fleet.routing import Decision
from services.gateway.text.chat_template import chat_ids

log = structlog.get_logger(__name__)
T = TypeVar("T")
FINISH_NAMES = {  # finish reasons as the APIs and metrics name them
    common_pb2.FINISH_REASON_STOP: "stop",
    common_pb2.FINISH_REASON_LENGTH: "length",
    common_pb2.FINISH_REASON_ABORT: "abort",
}


class GenerationCore:
    def __init__(
        self,
        config: GenerationSettings,
        tokenizer: PreTrainedTokenizerBase,
        pool: ExecutorPool,
        metrics: GatewayMetrics,
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.pool = pool
        self.metrics = metrics
        self.model_name = config.model_name
        self.admission = Admission(config.max_concurrent_requests, config.max_queued_requests)
        metrics.queued.set_function(lambda: self.admission.num_queued)
        self._tokenizer_threads = ThreadPoolExecutor(
            config.tokenizer_workers, thread_name_prefix="tokenizer"
        )
        self._tokenizer_slots = asyncio.Semaphore(4 * config.tokenizer_workers)

    # ---- generation ---------------------------------------------------------------------------

    @property
    def num_inflight(self) -> int:
        """Requests open on this gateway: being prepared, queued, or on an executor."""
        return self.admission.num_open

    async def generate(
        self,
        request: generation_pb2.GenerateRequest,
        *,
        default_max_tokens: int | None = DEFAULT_MAX_TOKENS,
        on_prompt: Callable[[list[int]], None] | None = None,
    ) -> AsyncGenerator[generation_pb2.GenerateResponse, None]:
        """Every response of the request's samples, in arrival order; each sample ends with
        one final message (finish reason and usage set). Raises :class:`GenerationError`.
        ``default_max_tokens`` None: an unset max_tokens fills the model's context.
        ``on_prompt`` is called once with the prompt's token ids, before the first
        response. Close the generator (``contextlib.aclosing``) when leaving it early."""
        self.enter()
        request_id = request.request_id or uuid.uuid4().hex
        structlog.contextvars.bind_contextvars(request_id=request_id)
        try:
            # Closed here, not by the garbage collector: its `finally` aborts on the executor.
            async with contextlib.aclosing(
                self._generate(request, request_id, default_max_tokens, on_prompt)
            ) as responses:
                async for response in responses:
                    yield response
        finally:
            self.admission.leave()
            self.metrics.inflight.dec()
            structlog.contextvars.unbind_contextvars("request_id")

    def enter(self) -> None:
        """Open one request (leave with ``admission.leave()``, ``inflight.dec()``), or raise
        RESOURCE_EXHAUSTED at once when running and queued requests are both full."""
        if not self.admission.try_enter():
            self.metrics.requests.labels("rejected_full").inc()
            raise GenerationError(
                ErrorKind.RESOURCE_EXHAUSTED,
                f"the gateway is at max_concurrent_requests="
                f"{self.config.max_concurrent_requests} running and max_queued_requests="
                f"{self.config.max_queued_requests} waiting; retry later",
            )
        self.metrics.inflight.inc()

    async def _generate(
        self,
        request: generation_pb2.GenerateRequest,
        request_id: str,
        default_max_tokens: int | None,
        on_prompt: Callable[[list[int]], None] | None,
    ) -> AsyncGenerator[generation_pb2.GenerateResponse, None]:
        start = time.monotonic()
        info = self.pool.info
        if info is None:
            self.metrics.requests.labels("unavailable").inc()
            raise GenerationError(ErrorKind.UNAVAILABLE, NO_EXECUTOR)
        limits = Limits(
            info.max_model_len,
            info.vocab_size,
            self.config.max_n,
            self.max_prompt_bytes(info.max_model_len),
        )
        try:
            check_runner(info.runner, "generate")
            check_request_id(request_id)
            prompt_ids = await self._prompt_ids(request, limits)
            params, options = sampling_to_executor(
                request, len(prompt_ids), limits, default_max_tokens
            )
        except FieldError as exc:
            self.metrics.requests.labels("invalid").inc()
            log.info("request_invalid", error=str(exc))
            raise GenerationError.invalid(exc) from None
        lora = request.lora_name
        if lora and not any(lora in c.adapters for c in self.pool.ready):
            self.metrics.requests.labels("invalid").inc()
            raise GenerationError(ErrorKind.NOT_FOUND, f"lora_name: no executor serves {lora!r}")
        if on_prompt is not None:
            on_prompt(prompt_ids)
        samples = [
            SampleStream(request_id, i, self.tokenizer, prompt_ids, options)
            for i in range(params.n)
        ]
        dispatched = False
        try:
            async with (
                self.admission.running(),  # waits here while the executors are full
                contextlib.aclosing(
                    self._run(request, request_id, prompt_ids, params, samples, start)
                ) as responses,
            ):
                dispatched = True
                async for response in responses:
                    yield response
        except asyncio.CancelledError:
            if not dispatched:  # gone while queued (once dispatched, _run counts it)
                log.info("request_cancelled", after_s=round(time.monotonic() - start, 4))
                self.metrics.requests.labels("cancelled").inc()
            raise

    async def _run(
        self,
        request: generation_pb2.GenerateRequest,
        request_id: str,
        prompt_ids: list[int],
        params: executor_pb2.ExecutorSamplingParams,
        samples: list[SampleStream],
        start: float,
    ) -> AsyncGenerator[generation_pb2.GenerateResponse, None]:
        """The request on an executor, from routing to its last sample's final message
        (``start``: when it arrived, for the latency metrics). An executor lost mid-stream
        is replaced: the samples carry on from their tokens so far (see ``resume``), up to
        ``--max-resumes`` times, each waiting at most ``--executor-wait-s`` for one."""
        original = executor_pb2.AddRequest(
            request_id=uuid.uuid4().hex,
            prompt_token_ids=prompt_ids,
            sampling_params=params,
            priority=request.priority,
            cache_salt=request.cache_salt.encode(),
            lora_name=request.lora_name,
        )
        queue: asyncio.Queue[Tagged] = asyncio.Queue()
        try:
            placement = self._place([(original, list(range(params.n)))], queue)
        except ExecutorUnavailable as exc:
            self.metrics.requests.labels("unavailable").inc()
            raise GenerationError(ErrorKind.UNAVAILABLE, str(exc)) from None
        log.info(
            "request_accepted",
            executor=placement.conn.address,
            routing=placement.decision.policy.value,
            predicted_cached_tokens=placement.decision.predicted_cached_tokens,
            num_prompt_tokens=len(prompt_ids),
            n=params.n,
            max_tokens=params.max_tokens,
        )

        last_token_at: list[float | None] = [None] * params.n
        done = 0
        resumes = 0
        completed = False
        outcome: str | None = None  # counted once in requests_total; None: cancelled
        stopped_here = False  # a stop string ended a sample the executor may still be running
        try:
            while done < params.n:
                tag, item = await queue.get()
                if tag not in placement.samples:
                    continue  # from an executor given up
                if isinstance(item, BaseException):
                    if resumes >= self.config.max_resumes or not isinstance(
                        item, ExecutorUnavailable
                    ):
                        outcome = "unavailable"
                        log.warning("executor_lost_mid_request", error=str(item))
                        raise GenerationError(ErrorKind.UNAVAILABLE, str(item))
                    resumes += 1
                    placement.release(abort=True)
                    try:
                        placement = await self._resume(original, samples, queue, item, resumes)
                    except GenerationError:
                        outcome = "unavailable"
                        raise
                    continue
                if isinstance(item, executor_pb2.RequestError):
                    kind = REFUSAL_KIND.get(item.code, ErrorKind.INTERNAL)
                    if resumes:  # the request was fine: the executor carrying it on refused
                        outcome = "unavailable"
                        raise GenerationError(
                            ErrorKind.UNAVAILABLE,
                            f"the executor the stream was resumed on refused it: {item.message}",
                        )
                    outcome = "refused" if kind != ErrorKind.INTERNAL else "error"
                    field = field_of(item.message) if kind is ErrorKind.INVALID_ARGUMENT else None
                    raise GenerationError(kind, item.message, field)
                index = placement.sample_of(tag, item.index)
                if index is None:
                    continue
                response, stopped = samples[index].process(item)
                if stopped:
                    stopped_here = True
                    if params.n > 1 and done + 1 < params.n:
                        placement.stop_sample(index)
                if response is None:
                    continue
                now = time.monotonic()
                if response.token_ids:
                    prev = last_token_at[index]
                    if prev is None:
                        if index == 0:
                            self.metrics.ttft.observe(now - start)
                    else:
                        self.metrics.itl.observe(now - prev)
                    last_token_at[index] = now
                    self.metrics.generation_tokens.inc(len(response.token_ids))
                if response.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
                    done += 1
                    placement.sample_done(tag, index, samples, abort=stopped)
                    self._record_final(response, placement.conn.address)
                    if index == 0:
                        outcome = FINISH_NAMES.get(response.finish_reason, "other")
                yield response
            completed = True
            self.metrics.e2e.observe(time.monotonic() - start)
            log.info(
                "request_finished",
                latency_s=round(time.monotonic() - start, 4),
                completion_tokens=[s.num_tokens for s in samples],
                resumes=resumes,
            )
        finally:
            # Cancelled, deadline passed, or failed: stop it on the executor right away.
            placement.release(abort=not completed or stopped_here)
            if not completed and outcome is None:
                log.info("request_cancelled", after_s=round(time.monotonic() - start, 4))
            self.metrics.requests.labels(outcome or "cancelled").inc()

    def _place(
        self,
        adds: list[tuple[executor_pb2.AddRequest, list[int]]],
        queue: asyncio.Queue[Tagged],
        accept: Callable[[ExecutorConnection], bool] | None = None,
    ) -> Placement:
        """Route ``adds`` (one request's executor-side requests) to one ready executor (of
        those ``accept`` takes), by the longest token sequence among them; raises
        :class:`ExecutorUnavailable`. A first placement counts in the routing metrics."""
        placement, num_tokens = Placement.route(self.pool, adds, queue, accept)
        if accept is None:
            self._record_route(placement.conn.address, placement.decision, num_tokens)
        return placement

    async def _resume(
        self,
        original: executor_pb2.AddRequest,
        samples: list[SampleStream],
        queue: asyncio.Queue[Tagged],
        lost: ExecutorUnavailable,
        resumes: int,
    ) -> Placement:
        """Carry the unfinished samples on, on a ready executor, waiting for one up to
        ``--executor-wait-s`` after the executor was lost; else UNAVAILABLE."""
        adds = resume_adds(original, samples)
        accept = executors_for(adds)
        wait_s = self.config.executor_wait_s
        placement = await place_again(
            self.pool, lost, wait_s, accept, lambda: self._place(adds, queue, accept)
        )
        if placement is None:
            log.warning("executor_lost_mid_request", error=str(lost), resumes=resumes - 1)
            raise GenerationError(ErrorKind.UNAVAILABLE, unavailable_message(lost, wait_s))
        self.metrics.resumed.labels(lost.reason or "executor_lost").inc()
        log.info(
            "request_resumed",
            reason=lost.reason,
            executor=placement.conn.address,
            resumes=resumes,
            waited_s=round(time.monotonic() - lost.since, 4),
            tokens_sent=[len(s.token_ids) for s in samples],
        )
        return placement

    def _record_route(self, executor: str, decision: Decision, num_prompt_tokens: int) -> None:
        m = self.metrics
        m.routed_requests.labels(executor, decision.policy.value).inc()
        m.routing_prompt_tokens.labels(executor).inc(num_prompt_tokens)
        m.routing_predicted_cached_tokens.labels(executor).inc(decision.predicted_cached_tokens)

    def _record_final(self, response: generation_pb2.GenerateResponse, executor: str) -> None:
        if response.index == 0:
            self.metrics.prompt_tokens.inc(response.usage.prompt_tokens)
            self.metrics.cached_prompt_tokens.inc(response.usage.cached_prompt_tokens)
            self.metrics.routing_cached_tokens.labels(executor).inc(
                response.usage.cached_prompt_tokens
            )

    # ---- prompts ------------------------------------------------------------------------------

    async def _prompt_ids(
        self, request: generation_pb2.GenerateRequest, limits: Limits
    ) -> list[int]:
        kind = check_input_kind(request)
        field = kind
        if kind == "prompt":
            check_prompt_bytes(kind, request.prompt, limits.max_prompt_bytes)
            ids = await self._off_loop(self._encode, request.prompt, True)
        elif kind == "prompt_token_ids":
            ids = list(request.prompt_token_ids.ids)
            field = "prompt_token_ids.ids"
        else:
            check_prompt_bytes(kind, request.messages, limits.max_prompt_bytes)
            ids = await self._off_loop(self._chat_ids, request.messages, "messages")
        check_prompt(ids, limits.vocab_size, limits.max_model_len, field)
        return ids

    async def _off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        """Run tokenizer work in the tokenizer threads (never on the event loop, where a
        megabyte prompt would stall every stream); at most a few jobs queue per thread."""
        async with self._tokenizer_slots:
            return await asyncio.get_running_loop().run_in_executor(
                self._tokenizer_threads, fn, *args
            )

    def max_prompt_bytes(self, max_model_len: int) -> int:
        return self.config.max_prompt_bytes or PROMPT_BYTES_PER_TOKEN * max_model_len

    async def encode(self, text: str, pair: str | None = None) -> list[int]:
        """``text``'s (and ``pair``'s, a pair's second) ids, special tokens in, off the loop."""
        return await self._off_loop(lambda: self.tokenizer(text, pair).input_ids)

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return self.tokenizer(text, add_special_tokens=add_special_tokens).input_ids

    def _chat_ids(self, messages: generation_pb2.ChatMessages, field: str) -> list[int]:
        check_messages(messages, field)
        return chat_ids(self.tokenizer, messages, field)

    # ---- the rest of the API ------------------------------------------------------------------

    async def tokenize(
        self, request: generation_pb2.TokenizeRequest
    ) -> generation_pb2.TokenizeResponse:
        kind = request.WhichOneof("input")
        try:
            info = self.pool.info
            limit = self.max_prompt_bytes(info.max_model_len if info is not None else 4096)
            if kind == "text":
                check_prompt_bytes(kind, request.text, limit)
                add = request.add_special_tokens if request.HasField("add_special_tokens") else True
                ids = await self._off_loop(self._encode, request.text, add)
            elif kind == "messages":
                check_prompt_bytes(kind, request.messages, limit)
                ids = await self._off_loop(self._chat_ids, request.messages, "messages")
            else:
                raise FieldError("input", "one of text or messages is required")
        except FieldError as exc:
            raise GenerationError.invalid(exc) from None
        tokens = self.tokenizer.convert_ids_to_tokens(ids)
        return generation_pb2.TokenizeResponse(token_ids=ids, tokens=tokens)

    def detokenize(
        self, request: generation_pb2.DetokenizeRequest
    ) -> generation_pb2.DetokenizeResponse:
        try:
            check_token_ids(list(request.token_ids), len(self.tokenizer), "token_ids")
        except FieldError as exc:
            raise GenerationError.invalid(exc) from None
        skip = request.skip_special_tokens if request.HasField("skip_special_tokens") else True
        text = self.tokenizer.decode(list(request.token_ids), skip_special_tokens=skip)
        return generation_pb2.DetokenizeResponse(text=cast(str, text))

    def model_info(self) -> generation_pb2.ModelInfo:
        ready = self.pool.ready
        if not ready:
            raise GenerationError(ErrorKind.UNAVAILABLE, NO_EXECUTOR)
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
