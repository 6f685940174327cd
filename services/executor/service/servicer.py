"""Thin grpc.aio servicer of ``pagedserve.v1.Executor`` over the :class:`EngineLoop`."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable
from concurrent.futures import ThreadPoolExecutor

import grpc
import structlog

from pagedserve.v1 import common_pb2, executor_pb2, executor_pb2_grpc
from services.blockmgr.api.hashing import HASH_ALGORITHM
from services.common.limits import FieldError
from services.common.sampling_params import SamplingParams, params_from_message
from services.common.structured_outputs import StructuredOutputs
from services.executor.core.outputs import RequestError, RequestErrorCode, SeqOutput, TokenLogprob
from services.executor.core.pooling import PoolingParams
from services.executor.core.sequence import FinishReason, Resume
from services.executor.model.parallel import WorkerLost
from services.executor.service.adapters import AdapterRpcs
from services.executor.service.commands import (
    Abort,
    Add,
    Close,
    Delivery,
    HalfClose,
    Load,
    Open,
    Refuse,
    Session,
)
from services.executor.service.engine_loop import EngineLoop
from services.executor.service.startup import ServedModel

log = structlog.get_logger(__name__)

FINISH_TO_PB = {
    FinishReason.STOP: common_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: common_pb2.FINISH_REASON_LENGTH,
    FinishReason.ABORT: common_pb2.FINISH_REASON_ABORT,
    FinishReason.ERROR: common_pb2.FINISH_REASON_ABORT,
}
ERROR_CODE_TO_PB = {
    RequestErrorCode.INVALID_ARGUMENT: executor_pb2.REQUEST_ERROR_CODE_INVALID_ARGUMENT,
    RequestErrorCode.ALREADY_EXISTS: executor_pb2.REQUEST_ERROR_CODE_ALREADY_EXISTS,
    RequestErrorCode.RESOURCE_EXHAUSTED: executor_pb2.REQUEST_ERROR_CODE_RESOURCE_EXHAUSTED,
    RequestErrorCode.INTERNAL: executor_pb2.REQUEST_ERROR_CODE_INTERNAL,
    RequestErrorCode.NOT_FOUND: executor_pb2.REQUEST_ERROR_CODE_NOT_FOUND,
    RequestErrorCode.FAILED_PRECONDITION: executor_pb2.REQUEST_ERROR_CODE_FAILED_PRECONDITION,
}


def params_from_pb(p: executor_pb2.ExecutorSamplingParams) -> SamplingParams:
    return params_from_message(p)


def _logprobs_to_pb(logprobs: Iterable[TokenLogprob]) -> list[common_pb2.TokenLogprob]:
    return [
        common_pb2.TokenLogprob(
            token_id=lp.token_id,
            logprob=lp.logprob,
            top_logprobs=[common_pb2.TopLogprob(token_id=t, logprob=v) for t, v in lp.top],
        )
        for lp in logprobs
    ]


def update_to_pb(out: SeqOutput) -> executor_pb2.SequenceUpdate:
    msg = executor_pb2.SequenceUpdate(
        request_id=out.req_id.request_id,
        index=out.index,
        token_ids=out.token_ids,
        logprobs=_logprobs_to_pb(out.logprobs),
    )
    if out.prompt_logprobs:
        msg.prompt_logprobs.extend(_logprobs_to_pb(out.prompt_logprobs))
    if out.embedding is not None:
        msg.embedding.extend(out.embedding)
    if out.finish_reason is not None:
        msg.finish_reason = FINISH_TO_PB[out.finish_reason]
        if out.stop_token_id is not None:
            msg.stop_token_id = out.stop_token_id
    if out.usage is not None:
        u = out.usage
        msg.usage.CopyFrom(
            common_pb2.Usage(
                prompt_tokens=u.prompt_tokens,
                completion_tokens=u.completion_tokens,
                cached_prompt_tokens=u.cached_prompt_tokens,
            )
        )
    return msg


def load_to_pb(load: Load) -> executor_pb2.ExecutorLoad:
    return executor_pb2.ExecutorLoad(**{f: getattr(load, f) for f in load.__slots__})


def delivery_to_pb(d: Delivery) -> executor_pb2.ExecutorStep:
    return executor_pb2.ExecutorStep(
        step=d.step,
        updates=[update_to_pb(o) for o in d.outputs],
        errors=[
            executor_pb2.RequestError(
                request_id=e.request_id, code=ERROR_CODE_TO_PB[e.code], message=e.message
            )
            for e in d.errors
        ],
        load=load_to_pb(d.load),
    )


class ExecutorServicer(AdapterRpcs, executor_pb2_grpc.ExecutorServicer):
    """Serves once :meth:`ready` is called with a running loop; UNAVAILABLE before."""

    def __init__(self) -> None:
        self.loop_: EngineLoop | None = None
        self.served: ServedModel | None = None
        self.info: executor_pb2.ExecutorInfo | None = None
        # Structured-output grammars are compiled here, off the engine thread: the request
        # goes in once its grammar is in the compiler's cache (or is refused), the others
        # are not held up.
        self._grammar_threads = ThreadPoolExecutor(2, thread_name_prefix="grammar")

    def ready(self, engine_loop: EngineLoop, served: ServedModel) -> None:
        self.loop_ = engine_loop
        self.served = served
        cfg = engine_loop.engine.settings.scheduler
        self.info = executor_pb2.ExecutorInfo(
            model_name=served.name,
            dtype=served.dtype,
            max_model_len=served.max_model_len,
            block_size=served.block_size,
            vocab_size=served.vocab_size,
            eos_token_ids=served.eos_token_ids,
            num_kv_blocks=served.num_kv_blocks,
            kv_capacity_tokens=(served.num_kv_blocks - 1) * served.block_size,
            hash_algorithm=HASH_ALGORITHM,
            max_num_seqs=cfg.max_num_seqs,
            max_num_batched_tokens=cfg.max_num_batched_tokens,
            enable_prefix_caching=cfg.enable_prefix_caching,
            device=served.device,
            pool_id=served.pool_id,
            tensor_parallel_size=served.tensor_parallel_size,
            resumes_samples=True,
            runner=served.runner,
            pooling_type=served.pooler.pooling_type.value if served.pooler else "",
            pooling_normalize=served.pooler.normalize if served.pooler else False,
            hidden_size=served.hidden_size,
            num_labels=len(served.labels),
            labels=served.labels,
        )

    async def Info(
        self, request: executor_pb2.ExecutorInfoRequest, context: grpc.aio.ServicerContext
    ) -> executor_pb2.ExecutorInfo:
        if self.info is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the model is still loading")
        assert self.info is not None
        return self.info

    async def Session(
        self,
        request_iterator: AsyncIterator[executor_pb2.SessionRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[executor_pb2.ExecutorStep]:
        engine_loop = self.loop_
        if engine_loop is None or not engine_loop.alive:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the engine is not running")
        assert engine_loop is not None
        aio_loop = asyncio.get_running_loop()
        inbox: asyncio.Queue[Delivery | None] = asyncio.Queue()
        session = Session(lambda d: aio_loop.call_soon_threadsafe(inbox.put_nowait, d))
        engine_loop.submit(Open(session))
        log.info("session_opened", session_id=session.session_id, peer=context.peer())

        grammars = engine_loop.engine.grammars
        compiling: dict[str, asyncio.Task[None]] = {}

        async def compile_then_add(add: Add, spec: StructuredOutputs) -> None:
            assert grammars is not None
            try:
                await aio_loop.run_in_executor(self._grammar_threads, grammars.compile, spec)
            except FieldError as exc:
                error = str(exc.under("sampling_params"))
                code = RequestErrorCode.INVALID_ARGUMENT
                engine_loop.submit(Refuse(session, RequestError(add.request_id, code, error)))
            else:
                engine_loop.submit(add)
            finally:
                compiling.pop(add.request_id, None)

        async def read() -> None:
            async for req in request_iterator:
                kind = req.WhichOneof("kind")
                if kind == "add":
                    command = _add_command(session, req.add)
                    params = command.params if isinstance(command, Add) else None
                    spec = params.structured_outputs if params is not None else None
                    if spec is not None and grammars is not None:
                        assert isinstance(command, Add)
                        task = asyncio.create_task(compile_then_add(command, spec))
                        compiling[command.request_id] = task
                    else:
                        engine_loop.submit(command)
                elif kind == "abort":
                    index = req.abort.index if req.abort.HasField("index") else None
                    waiting = compiling.pop(req.abort.request_id, None) if index is None else None
                    if waiting is not None:
                        waiting.cancel()  # never reaches the engine
                    else:
                        engine_loop.submit(Abort(session, req.abort.request_id, index))
            await asyncio.gather(*compiling.values(), return_exceptions=True)
            engine_loop.submit(HalfClose(session))

        reader = asyncio.create_task(read())
        try:
            while True:
                delivery = await inbox.get()
                if delivery is None:
                    if isinstance(engine_loop.error, WorkerLost):  # the executor is going down
                        await context.abort(
                            grpc.StatusCode.UNAVAILABLE,
                            f"executor lost a rank: {engine_loop.error}",
                        )
                    if engine_loop.error is not None:
                        await context.abort(
                            grpc.StatusCode.INTERNAL, f"engine failed: {engine_loop.error!r}"
                        )
                    return
                yield delivery_to_pb(delivery)
        finally:
            reader.cancel()
            for task in compiling.values():
                task.cancel()
            engine_loop.submit(Close(session))


def _add_command(session: Session, add: executor_pb2.AddRequest) -> Add | Refuse:
    pooling = None
    if add.HasField("pooling"):  # (the engine refuses it unless it is a pooling one)
        p = add.pooling
        pooling = PoolingParams(
            p.dimensions if p.HasField("dimensions") else None,
            p.normalize if p.HasField("normalize") else None,
        )
        if add.HasField("sampling_params"):
            return _refuse(session, add, "sampling_params: must be unset on a pooling request")
    elif not add.HasField("sampling_params"):
        return _refuse(session, add, "sampling_params: is required")
    return Add(
        session,
        add.request_id,
        list(add.prompt_token_ids),
        params_from_pb(add.sampling_params) if pooling is None else None,
        add.priority,
        add.cache_salt,
        Resume(add.resume.sample_index, tuple(add.resume.output_token_ids))
        if add.HasField("resume")
        else None,
        add.lora_name,
        pooling,
    )


def _refuse(session: Session, add: executor_pb2.AddRequest, message: str) -> Refuse:
    error = RequestError(add.request_id, RequestErrorCode.INVALID_ARGUMENT, message)
    return Refuse(session, error)
