"""SMG's engine gRPC service, ``vllm.grpc.engine.VllmEngine``, served by the executor beside
its own ``Executor`` service (same port, same internal token), so that the SGLang / vLLM
model gateway (SMG) routes to pagedserve executors with no change to it.

Served in the executor rather than by an adapter process: SMG tokenizes, detokenizes and
matches stop strings itself and sends token ids, which is exactly what the executor takes; an
adapter would add a hop and a process for a translation of messages.

Each ``Generate`` call is one engine session of its own (as a gateway's stream is): its
request, streamed as ``chunk`` messages when ``stream`` is set, then one ``complete`` per
sample index; a call cancelled or whose client went away aborts its request at the next step
boundary (its blocks are freed). ``Abort`` aborts by request id. ``Embed`` serves a pooling
executor (``--runner pooling``). ``GetTokenizer`` streams a zip of the checkpoint's tokenizer
files with its SHA-256 on the last chunk. ``SubscribeKvEvents`` relays the pool's KV events
in SMG's form (:mod:`.smg_kv_events`), the input of its event-driven prefix index. Not
served yet (UNIMPLEMENTED): ``FlushCache`` and the profiler calls."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections.abc import AsyncIterator, Callable
from importlib.metadata import PackageNotFoundError, version

import grpc
import structlog
from smg_grpc_proto.generated import common_pb2 as smg_common
from smg_grpc_proto.generated import vllm_engine_pb2 as pb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as pb_grpc

from services.blockmgr.api.protocol import EventStream
from services.blockmgr.api.types import AttentionKindName, KVEvent
from services.common.limits import FieldError, check_prompt
from services.executor.core.outputs import RequestErrorCode, SeqOutput, TokenLogprob
from services.executor.core.pooling import PoolingParams
from services.executor.service.commands import (
    Abort,
    Add,
    Close,
    Delivery,
    HalfClose,
    Open,
    Session,
)
from services.executor.service.engine_loop import EngineLoop
from services.executor.service.smg_convert import (
    FINISH_NAMES,
    loads_pb,
    model_type_and_architectures,
    output_logprobs,
    params_from_smg,
    tokenizer_chunks,
)
from services.executor.service.smg_kv_events import to_smg_batches
from services.executor.service.startup import ServedModel

__all__ = ["SmgEngineServicer"]

log = structlog.get_logger(__name__)
try:
    VERSION = f"pagedserve-{version('pagedserve')}"
except PackageNotFoundError:  # run from a source tree that was not installed
    VERSION = "pagedserve"
_STATUS = {
    RequestErrorCode.INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT,
    RequestErrorCode.ALREADY_EXISTS: grpc.StatusCode.ALREADY_EXISTS,
    RequestErrorCode.RESOURCE_EXHAUSTED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    RequestErrorCode.NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    RequestErrorCode.FAILED_PRECONDITION: grpc.StatusCode.FAILED_PRECONDITION,
}


class _Sample:
    """One sample index's output so far."""

    __slots__ = ("logprobs", "tokens")

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.logprobs: list[TokenLogprob] = []


class SmgEngineServicer(pb_grpc.VllmEngineServicer):
    def __init__(self) -> None:
        self.loop_: EngineLoop | None = None
        self.served: ServedModel | None = None
        self.model_dir = ""
        self.started = time.time()
        self.last_receive = 0.0
        self._live: dict[str, Session] = {}  # SMG request id -> its session

    def ready(self, engine_loop: EngineLoop, served: ServedModel, model_dir: str) -> None:
        self.loop_, self.served, self.model_dir = engine_loop, served, model_dir

    async def _engine(self, context: grpc.aio.ServicerContext) -> tuple[EngineLoop, ServedModel]:
        if self.loop_ is None or self.served is None or not self.loop_.alive:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the engine is not running")
        assert self.loop_ is not None and self.served is not None
        return self.loop_, self.served

    # ---- requests -------------------------------------------------------------------------

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        engine_loop, served = await self._engine(context)
        self.last_receive = time.time()
        try:
            if request.WhichOneof("input") != "tokenized":
                raise FieldError("input", "send tokenized.input_ids (the router tokenizes)")
            ids = list(request.tokenized.input_ids)
            check_prompt(ids, served.vocab_size, served.max_model_len, "tokenized.input_ids")
            params = params_from_smg(request.sampling_params, served.vocab_size)
            grammars = engine_loop.engine.grammars
            if params.structured_outputs is not None and grammars is not None:
                try:
                    await asyncio.to_thread(grammars.compile, params.structured_outputs)
                except FieldError as exc:
                    raise exc.under("sampling_params") from None
        except FieldError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            raise AssertionError from None  # (abort raises)

        def add(session: Session) -> Add:
            return Add(session, request.request_id, ids, params)

        log.info("smg_request", request_id=request.request_id, num_prompt_tokens=len(ids))

        samples = [_Sample() for _ in range(params.n)]
        async for out in self._run(engine_loop, request.request_id, add, context):
            sample = samples[out.index]
            sample.tokens += out.token_ids
            sample.logprobs += out.logprobs
            usage = out.usage
            counts = {
                "prompt_tokens": len(ids),
                "completion_tokens": len(sample.tokens),
                "cached_tokens": usage.cached_prompt_tokens if usage is not None else 0,
            }
            want_lp = params.logprobs is not None
            if request.stream and out.token_ids:
                chunk = pb.GenerateStreamChunk(token_ids=out.token_ids, index=out.index, **counts)
                if want_lp:
                    chunk.output_logprobs.CopyFrom(output_logprobs(list(out.logprobs)))
                yield pb.GenerateResponse(chunk=chunk)
            if out.finish_reason is not None:
                done = pb.GenerateComplete(
                    output_ids=sample.tokens,
                    finish_reason=FINISH_NAMES.get(out.finish_reason, "abort"),
                    index=out.index,
                    **counts,
                )
                if want_lp:
                    done.output_logprobs.CopyFrom(output_logprobs(sample.logprobs))
                if out.stop_token_id is not None:
                    done.matched_token_id = out.stop_token_id
                yield pb.GenerateResponse(complete=done)

    async def Embed(
        self, request: pb.EmbedRequest, context: grpc.aio.ServicerContext
    ) -> pb.EmbedResponse:
        engine_loop, served = await self._engine(context)
        self.last_receive = time.time()
        ids = list(request.tokenized.input_ids)
        try:
            check_prompt(ids, served.vocab_size, served.max_model_len, "tokenized.input_ids")
        except FieldError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))

        def add(session: Session) -> Add:
            return Add(session, request.request_id, ids, None, pooling=PoolingParams())

        async for out in self._run(engine_loop, request.request_id, add, context):
            if out.embedding is not None:
                vector = out.embedding
                return pb.EmbedResponse(
                    embedding=vector, prompt_tokens=len(ids), embedding_dim=len(vector)
                )
        await context.abort(grpc.StatusCode.INTERNAL, "the request ended without a vector")
        raise AssertionError  # (abort raises)

    async def _run(
        self,
        engine_loop: EngineLoop,
        request_id: str,
        add: Callable[[Session], Add],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[SeqOutput]:
        """The outputs of one request run in a session of its own; a refusal aborts the
        call with its status; leaving early (cancelled, client gone) aborts the request."""
        if request_id in self._live:
            await context.abort(
                grpc.StatusCode.ALREADY_EXISTS, f"request_id {request_id!r} is already running"
            )
        aio_loop = asyncio.get_running_loop()
        inbox: asyncio.Queue[Delivery | None] = asyncio.Queue()
        session = Session(lambda d: aio_loop.call_soon_threadsafe(inbox.put_nowait, d))
        engine_loop.submit(Open(session))
        engine_loop.submit(add(session))
        engine_loop.submit(HalfClose(session))
        self._live[request_id] = session
        finished = False
        try:
            while (delivery := await inbox.get()) is not None:
                for error in delivery.errors:
                    status = _STATUS.get(error.code, grpc.StatusCode.INTERNAL)
                    await context.abort(status, error.message)
                for out in delivery.outputs:
                    yield out
            finished = True
            if engine_loop.error is not None:
                await context.abort(grpc.StatusCode.UNAVAILABLE, "the engine failed")
        finally:
            self._live.pop(request_id, None)
            if not finished:
                engine_loop.submit(Close(session))  # abort what it still runs

    async def Abort(
        self, request: pb.AbortRequest, context: grpc.aio.ServicerContext
    ) -> pb.AbortResponse:
        engine_loop, _ = await self._engine(context)
        for request_id in request.request_ids:
            session = self._live.get(request_id)
            if session is not None:
                engine_loop.submit(Abort(session, request_id))
        return pb.AbortResponse()

    # ---- state ----------------------------------------------------------------------------

    async def HealthCheck(
        self, request: pb.HealthCheckRequest, context: grpc.aio.ServicerContext
    ) -> pb.HealthCheckResponse:
        loop = self.loop_
        if loop is None:
            return pb.HealthCheckResponse(healthy=False, message="the model is still loading")
        if not loop.alive:
            return pb.HealthCheckResponse(healthy=False, message="the engine is not running")
        if not loop.engine.link.healthy:
            return pb.HealthCheckResponse(healthy=False, message="the block manager is down")
        return pb.HealthCheckResponse(healthy=True, message="serving")

    async def GetModelInfo(
        self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetModelInfoResponse:
        _, served = await self._engine(context)
        model_type, architectures = model_type_and_architectures(self.model_dir)
        return pb.GetModelInfoResponse(
            model_path=self.model_dir,
            is_generation=served.runner == "generate",
            max_context_length=served.max_model_len,
            vocab_size=served.vocab_size,
            served_model_name=served.name,
            tokenizer_path=self.model_dir,
            model_type=model_type,
            architectures=architectures,
            eos_token_ids=list(served.eos_token_ids),
            max_req_input_len=served.max_model_len - 1,
            default_sampling_params_json="{}",
        )

    async def GetServerInfo(
        self, request: pb.GetServerInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetServerInfoResponse:
        return pb.GetServerInfoResponse(
            active_requests=len(self._live),
            last_receive_timestamp=self.last_receive,
            uptime_seconds=time.time() - self.started,
            server_type="vllm-grpc",  # the protocol flavour SMG speaks to this server
            data_parallel_size=1,
        )

    async def GetLoads(
        self, request: pb.GetLoadsRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetLoadsResponse:
        engine_loop, served = await self._engine(context)
        capacity = (served.num_kv_blocks - 1) * served.block_size
        max_seqs = engine_loop.engine.settings.scheduler.max_num_seqs
        return loads_pb(engine_loop.load, capacity, max_seqs, VERSION)

    async def SubscribeKvEvents(
        self, request: smg_common.SubscribeKvEventsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[smg_common.KvEventBatch]:
        """The pool's KV events in SMG's form (:mod:`.smg_kv_events`) from
        ``start_sequence_number`` on (0: whatever the block manager still buffers), until the
        subscriber goes away; UNAVAILABLE when the block manager's stream breaks (SMG
        subscribes again from its cursor)."""
        engine_loop, served = await self._engine(context)
        engine, link = engine_loop.engine, engine_loop.engine.link
        groups = link.spec.groups  # (none: one full-attention group)
        full = frozenset(i for i, g in enumerate(groups) if g.kind is AttentionKindName.FULL)
        full = full if groups else frozenset({0})  # (a model whose every layer slides: none)
        blocks = engine.scheduler.block_tokens
        blocks.enable()
        stream = link.client.events(link.pool_id, max(0, request.start_sequence_number - 1))
        log.info("smg_kv_events_subscribed", start_sequence_number=request.start_sequence_number)
        queue: asyncio.Queue[list[KVEvent] | Exception | None] = asyncio.Queue(maxsize=256)
        threading.Thread(
            target=_pump, args=(stream, queue, asyncio.get_running_loop()), daemon=True
        ).start()
        try:
            while (item := await queue.get()) is not None:
                if isinstance(item, Exception):
                    await context.abort(grpc.StatusCode.UNAVAILABLE, f"KV events: {item}")
                assert not isinstance(item, Exception)
                for batch in to_smg_batches(item, blocks, served.block_size, full):
                    yield batch
        finally:
            stream.close()
            while not queue.empty():  # (a pump waiting on a full queue goes on to its end)
                queue.get_nowait()

    async def GetTokenizer(
        self, request: smg_common.GetTokenizerRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[smg_common.GetTokenizerChunk]:
        await self._engine(context)
        for chunk in await asyncio.to_thread(tokenizer_chunks, self.model_dir):
            yield chunk


def _pump(
    stream: EventStream,
    queue: asyncio.Queue[list[KVEvent] | Exception | None],
    loop: asyncio.AbstractEventLoop,
) -> None:
    """Hand a block-manager event stream's deliveries (blocking) to ``queue`` on ``loop``,
    waiting while it is full (a slow subscriber slows the stream, which the block manager
    buffers); its error, then None at its end."""

    def put(item: list[KVEvent] | Exception | None) -> bool:
        try:
            asyncio.run_coroutine_threadsafe(queue.put(item), loop).result(timeout=60)
        except (TimeoutError, RuntimeError, concurrent.futures.CancelledError):
            return False  # the subscriber is gone (its loop closed, or it stopped reading)
        return True

    try:
        for events in stream:
            if not put(events):
                return
        put(None)
    except Exception as exc:  # (a broken stream: BlockManagerError, or anything unexpected)
        put(exc)
