"""A request whose client leaves (deadline passed, call cancelled) while it waits in the
gateway frees everything at once: its admission place, the ``requests_inflight`` gauge, and
its executor-side request; it is counted once as ``cancelled``.

In process, against a fake executor: the generation core alone (the handler task cancelled,
as gRPC cancels it), and behind the real gRPC servicer. The latter pins down why a test that
reads the gauge right after its client saw ``DEADLINE_EXCEEDED`` is racy: the client's status
comes from the client's own deadline timer, and the gateway learns of it only afterwards, so
its clean-up (run when gRPC cancels the handler) cannot precede the status. A test waits for
the gauge to settle instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import grpc
import pytest
from transformers import PreTrainedTokenizerBase

from pagedserve.testing.procs import wait_until
from pagedserve.v1 import executor_pb2, generation_pb2_grpc
from pagedserve.v1 import generation_pb2 as G
from services.gateway.api.grpc import GenerationServicer
from services.gateway.core.generation import GenerationCore
from services.gateway.core.metrics import GatewayMetrics
from services.gateway.fleet.executor_client import ExecutorPool, ExecutorUnavailable, Tagged
from services.gateway.service.config import GatewayConfig

T = TypeVar("T")
ADDRESS = "fake-executor:1"


class FakeExecutor:
    """An executor connection that takes requests and can be lost (its stream broken)."""

    def __init__(self) -> None:
        self.address = ADDRESS
        self.info = executor_pb2.ExecutorInfo(
            model_name="tiny", max_model_len=512, vocab_size=512, block_size=16,
            resumes_samples=True,
        )  # fmt: skip
        self.load: executor_pb2.ExecutorLoad | None = None
        self.load_tokens = 0
        self.ready = True
        self.draining = False
        self.requests: dict[str, asyncio.Queue[Tagged]] = {}
        self.aborted: list[str] = []
        self.lost_on_submit = False  # lost as soon as it takes a request

    def submit(self, add: executor_pb2.AddRequest, queue: asyncio.Queue[Tagged]) -> None:
        if not self.ready:
            raise ExecutorUnavailable(f"executor {self.address} is not ready")
        self.requests[add.request_id] = queue
        if self.lost_on_submit:
            asyncio.get_running_loop().call_soon(self.lose)

    def release(self, request_id: str, *, abort: bool) -> None:
        if self.requests.pop(request_id, None) is not None and abort:
            self.aborted.append(request_id)

    def abort_sample(self, request_id: str, index: int) -> None:
        pass

    def send_token(self, token_id: int) -> None:
        for request_id, queue in self.requests.items():
            update = executor_pb2.SequenceUpdate(request_id=request_id, token_ids=[token_id])
            queue.put_nowait((request_id, update))

    def lose(self) -> None:
        """Its stream broke: every request on it hears so (as ``ExecutorConnection``)."""
        self.ready = False
        requests, self.requests = self.requests, {}
        for request_id, queue in requests.items():
            lost = ExecutorUnavailable(f"executor {self.address} is unavailable", reason="lost")
            queue.put_nowait((request_id, lost))


class Pool(ExecutorPool):
    """The real pool (routing, ``wait_ready``) over one fake executor; once a request waits
    for an executor to serve again, ``waiting`` is set and ``on_wait`` called."""

    def __init__(self, executor: FakeExecutor) -> None:
        super().__init__(())
        self._by_address[executor.address] = executor  # type: ignore[assignment]
        self.waiting = asyncio.Event()
        self.on_wait: Callable[[], object] = lambda: None

    async def wait_ready(self, timeout: float, accept: Any = None) -> bool:
        self.waiting.set()
        self.on_wait()
        return await super().wait_ready(timeout, accept)


class Gateway:
    """A generation core over a fake executor (no real wait for it runs out: 600 s)."""

    def __init__(self, model: Path, tokenizer: PreTrainedTokenizerBase, **config: Any) -> None:
        self.executor = FakeExecutor()
        self.pool = Pool(self.executor)
        self.metrics = GatewayMetrics(list)
        self.config = GatewayConfig(model=str(model), executor_wait_s=600, **config)
        self.core = GenerationCore(
            self.config.generation_settings(), tokenizer, self.pool, self.metrics
        )

    def admission_state(self) -> tuple[int, int, int]:
        """(open, running, queued) requests."""
        a = self.core.admission
        return a.num_open, a.num_running, a.num_queued

    def value(self, name: str, **labels: str) -> float:
        value = self.metrics.registry.get_sample_value(name, labels)
        return 0.0 if value is None else value

    @property
    def inflight(self) -> float:
        return self.value("pagedserve_gateway_requests_inflight")

    @property
    def cancelled(self) -> float:
        return self.value("pagedserve_requests_total", outcome="cancelled")


def _request(max_tokens: int = 8) -> G.GenerateRequest:
    return G.GenerateRequest(
        prompt_token_ids=G.TokenIds(ids=[1, 5, 9]),
        sampling_params=G.SamplingParams(max_tokens=max_tokens, temperature=0),
    )


async def _consume(core: GenerationCore, got: list[G.GenerateResponse]) -> None:
    async with contextlib.aclosing(core.generate(_request())) as responses:
        async for response in responses:
            got.append(response)


async def _cancelled(task: asyncio.Task[None]) -> None:
    """``task`` (just cancelled) ends cancelled; a cancellation swallowed on the way (the
    request would then wait on for an executor, 600 s) fails the test instead of hanging it."""
    await asyncio.wait({task}, timeout=60)
    assert task.cancelled(), "the cancellation did not end the request"


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


# ---- the core: cancelled while waiting -------------------------------------------------------


def test_cancelled_while_waiting_for_an_executor_frees_the_request_at_once(
    tiny_model_dir: Path, tokenizer: PreTrainedTokenizerBase
) -> None:
    async def scenario() -> None:
        gw = Gateway(tiny_model_dir, tokenizer)
        got: list[G.GenerateResponse] = []
        task = asyncio.create_task(_consume(gw.core, got))
        await _settle()
        assert len(gw.executor.requests) == 1
        gw.executor.send_token(42)
        await _settle()
        assert [r.token_ids for r in got] == [[42]]
        gw.executor.lose()  # mid-stream: the request waits for an executor to carry it on
        await gw.pool.waiting.wait()
        assert gw.inflight == 1 and gw.core.num_inflight == 1
        task.cancel()  # what gRPC does to the handler once the deadline has passed
        await _cancelled(task)
        # At once, not once some wait runs out.
        assert gw.inflight == 0 and gw.core.num_inflight == 0
        assert gw.admission_state() == (0, 0, 0)
        assert gw.cancelled == 1
        assert gw.value("pagedserve_requests_resumed_total", reason="lost") == 0

    asyncio.run(scenario())


def test_cancelled_while_queued_for_a_running_slot_frees_its_place_at_once(
    tiny_model_dir: Path, tokenizer: PreTrainedTokenizerBase
) -> None:
    async def scenario() -> None:
        gw = Gateway(tiny_model_dir, tokenizer, max_concurrent_requests=1)
        running = asyncio.create_task(_consume(gw.core, []))
        queued = asyncio.create_task(_consume(gw.core, []))
        await _settle()
        assert len(gw.executor.requests) == 1 and gw.core.admission.num_queued == 1
        assert gw.inflight == 2
        queued.cancel()  # its deadline passed while it waited here
        await _cancelled(queued)
        assert gw.inflight == 1 and gw.core.admission.num_queued == 0
        assert gw.cancelled == 1
        running.cancel()
        await _cancelled(running)
        assert gw.inflight == 0 and gw.admission_state() == (0, 0, 0)
        assert gw.cancelled == 2 and len(gw.executor.aborted) == 1

    asyncio.run(scenario())


# ---- behind gRPC: the client's status comes first ----------------------------------------


class LoopThread:
    """An event loop on its own thread (the gateway process's, as seen from a client)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(60)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(60)
        self.loop.close()


class Served:
    """The gateway's gRPC front over :class:`Gateway`, on :class:`LoopThread`."""

    def __init__(self, model: Path, tokenizer: PreTrainedTokenizerBase) -> None:
        self.thread = LoopThread()
        self.gw, self.server, port = self.thread.run(self._start(model, tokenizer))
        self.channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        self.stub = generation_pb2_grpc.GenerationStub(self.channel)

    async def _start(
        self, model: Path, tokenizer: PreTrainedTokenizerBase
    ) -> tuple[Gateway, grpc.aio.Server, int]:
        gw = Gateway(model, tokenizer)
        server = grpc.aio.server()
        generation_pb2_grpc.add_GenerationServicer_to_server(GenerationServicer(gw.core), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        return gw, server, port

    def close(self) -> None:
        self.channel.close()
        self.thread.run(self.server.stop(None))
        self.thread.close()


@pytest.fixture
def served(tiny_model_dir: Path, tokenizer: PreTrainedTokenizerBase) -> Iterator[Served]:
    s = Served(tiny_model_dir, tokenizer)
    yield s
    s.close()


@pytest.mark.parametrize("how", ["deadline", "cancel"])
def test_the_client_sees_its_status_before_the_gateway_frees_the_request(
    served: Served, how: str
) -> None:
    """The gateway's loop is held up (a loaded machine) from the moment the request waits for
    an executor: the client still gets its status, while the gateway cannot have freed the
    request yet; once the loop runs again the gauge settles to 0, counted as cancelled."""
    gw = served.gw
    blocked, unblock = threading.Event(), threading.Event()

    def hold_the_loop() -> None:
        blocked.set()
        unblock.wait(120)

    gw.pool.on_wait = lambda: served.thread.loop.call_soon(hold_the_loop)
    # The executor is lost once it has the request: the request then waits for another.
    gw.executor.lost_on_submit = True
    # The request must reach that wait within its deadline: milliseconds of in-process work.
    timeout = 5.0 if how == "deadline" else 600.0
    call = served.stub.Generate(_request(), timeout=timeout)
    try:
        assert blocked.wait(60), "the request never waited for an executor"
        if how == "cancel":
            call.cancel()
        with pytest.raises(grpc.RpcError) as info:
            list(call)
        code = grpc.StatusCode.DEADLINE_EXCEEDED if how == "deadline" else grpc.StatusCode.CANCELLED
        assert info.value.code() == code
        # The client has its status; the gateway has not run since the request began to wait.
        assert gw.inflight == 1 and gw.cancelled == 0
    finally:
        unblock.set()
    wait_until(lambda: gw.inflight == 0, what="the inflight gauge back to 0")
    assert gw.cancelled == 1 and gw.admission_state() == (0, 0, 0)
