"""Tensor parallelism through the service: an executor at ``--tensor-parallel-size 2`` (gloo,
two real processes) behind a real gateway streams the tokens of the one-rank stack, and a
rank killed mid-stream makes the executor end its streams and exit non-zero within seconds
(the gateway, left without an executor, fails the stream once ``--executor-wait-s`` is
over)."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from pagedserve.testing.procs import ServiceProcess, gateway_args, wait_serving
from pagedserve.v1 import executor_pb2, executor_pb2_grpc
from pagedserve.v1 import generation_pb2 as G

from .conftest import Stack, stack_executor_args
from .test_generate_e2e import collect, greedy

PROMPTS = [
    "The train",
    "A good cup of tea needs only three things: fresh water, a warm pot",
    "How does a server answer many requests at once? It keeps a queue of work.",
]


@pytest.fixture(scope="module")
def tp2_stack(tiny_model_dir: Path) -> Iterator[tuple[ServiceProcess, ServiceProcess]]:
    """An in-process-block-manager executor of two ranks, and a gateway in front of it. The
    last test of this module kills a rank: it must stay last."""
    executor = ServiceProcess(
        stack_executor_args(tiny_model_dir, "--tensor-parallel-size", "2", "--pool-id", "tp2"),
        "executor_ready",
    )
    gateway = ServiceProcess(
        gateway_args(tiny_model_dir, executor.address, "--executor-wait-s", "2"),
        "gateway_listening",
    )
    try:
        wait_serving(gateway.address)
        yield executor, gateway
    finally:
        gateway.stop()
        executor.stop()


def _generate_all(stub, n: int = 2) -> list[dict[int, dict]]:
    """The prompts at once (n samples each, greedy), so that they batch together."""
    results: list[dict[int, dict] | None] = [None] * len(PROMPTS)

    def one(i: int) -> None:
        req = G.GenerateRequest(prompt=PROMPTS[i], sampling_params=greedy(24, n=n))
        results[i] = collect(stub.Generate(req, timeout=60))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    assert all(r is not None for r in results)
    return results  # type: ignore[return-value]


def test_executor_at_tp2_streams_the_tokens_of_one_rank(stack: Stack, tp2_stack) -> None:
    executor, gateway = tp2_stack
    with grpc.insecure_channel(executor.address) as channel:
        info = executor_pb2_grpc.ExecutorStub(channel).Info(executor_pb2.ExecutorInfoRequest())
    assert info.tensor_parallel_size == 2
    one_rank = _generate_all(stack.stub())
    two_ranks = _generate_all(stack.stub(gateway.address))
    for a, b in zip(one_rank, two_ranks, strict=True):
        assert {i: s["tokens"] for i, s in b.items()} == {i: s["tokens"] for i, s in a.items()}
        assert {i: s["text"] for i, s in b.items()} == {i: s["text"] for i, s in a.items()}
        assert all(s["finals"] == 1 and len(s["tokens"]) > 0 for s in b.values())


def test_a_killed_rank_ends_streams_and_the_executor_exits(tp2_stack) -> None:
    executor, gateway = tp2_stack
    started = executor.wait_for_event("tensor_parallel_started")
    (worker_pid,) = started["worker_pids"]
    stub = Stack.stub(None, gateway.address)  # type: ignore[arg-type]
    req = G.GenerateRequest(
        prompt="Once upon a time",
        sampling_params=G.SamplingParams(max_tokens=450, temperature=0.0, ignore_eos=True),
    )
    first = threading.Event()
    outcome: dict[str, object] = {"tokens": 0}

    def stream() -> None:
        try:
            for resp in stub.Generate(req, timeout=60):
                outcome["tokens"] = int(outcome["tokens"]) + len(resp.token_ids)  # type: ignore[call-overload]
                first.set()
            outcome["code"] = grpc.StatusCode.OK
        except grpc.RpcError as exc:
            outcome["code"], outcome["details"] = exc.code(), exc.details()
        first.set()

    t = threading.Thread(target=stream)
    t.start()
    assert first.wait(60)
    os.kill(worker_pid, signal.SIGKILL)
    t.join(60)
    assert outcome.get("code") == grpc.StatusCode.UNAVAILABLE, outcome
    assert int(outcome["tokens"]) < 450  # type: ignore[call-overload]
    # It exits (failing) rather than hanging in a collective until --distributed-timeout.
    code = executor.proc.wait(60)
    assert code != 0
    assert "tensor_parallel_worker_lost" in executor.events() or any(
        "WorkerLost" in str(r.get("error", "")) for r in executor.lines
    )
    # The gateway refuses new work at once rather than hanging.
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(req, timeout=20))
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
