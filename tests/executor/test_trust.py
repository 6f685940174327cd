"""Trust between the services, with real processes: the internal token on the executor and
the block manager, the executor's per-session cap, and the pool's lifecycle (kept alive while
idle, unregistered on shutdown, reclaimed after its owner was killed)."""

from __future__ import annotations

import queue
import signal
import time
from collections.abc import Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagedserve.testing.procs import ServiceProcess, executor_args, wait_until
from pagedserve.v1 import executor_pb2, executor_pb2_grpc
from services.blockmgr.api.errors import BlockManagerError
from services.blockmgr.api.types import PoolSpec
from services.blockmgr.client import GrpcClient
from services.common.auth import INTERNAL_TOKEN_HEADER

TOKEN = "trust-test-token"
METADATA = ((INTERNAL_TOKEN_HEADER, TOKEN),)
# The executor registers its pool once its slow start-up is done (test_startup_order.py), and
# an idle executor renews the lease once a third of it has passed (checked every half second).
LEASE_S = 6.0


def _executor(model: str, blockmgr: ServiceProcess, pool_id: str, *extra: str) -> ServiceProcess:
    args = executor_args(
        model,
        blockmgr.address,
        "--dtype",
        "float32",
        "--pool-id",
        pool_id,
        "--internal-token",
        TOKEN,
        *extra,
    )
    return ServiceProcess(args, "executor_ready")


@pytest.fixture(scope="module")
def blockmgr() -> Iterator[ServiceProcess]:
    bm = ServiceProcess(
        ["blockmgr", "--port", "0", "--internal-token", TOKEN, "--pool-lease-s", str(LEASE_S)],
        "blockmgr_listening",
    )
    yield bm
    bm.stop()


@pytest.fixture(scope="module")
def executor(blockmgr, tiny_checkpoint) -> Iterator[ServiceProcess]:
    ex = _executor(
        str(tiny_checkpoint("llama")), blockmgr, "trusted", "--max-seqs-per-session", "4"
    )
    yield ex
    ex.stop()


def _pools(blockmgr: ServiceProcess) -> dict[str, int]:
    client = GrpcClient(blockmgr.address, internal_token=TOKEN)
    try:
        return {p.pool_id: p.epoch for p in client.info().pools}
    finally:
        client.close()


class Session:
    def __init__(self, channel: grpc.Channel, metadata=METADATA) -> None:
        self._out: queue.SimpleQueue = queue.SimpleQueue()
        stub = executor_pb2_grpc.ExecutorStub(channel)
        self.call = stub.Session(iter(self._out.get, None), metadata=metadata)

    def add(self, request_id: str, n: int, max_tokens: int) -> None:
        params = executor_pb2.ExecutorSamplingParams(
            n=n, temperature=0.0, top_p=1.0, repetition_penalty=1.0, max_tokens=max_tokens
        )
        add = executor_pb2.AddRequest(
            request_id=request_id, prompt_token_ids=[1, 5, 9], sampling_params=params
        )
        self._out.put(executor_pb2.SessionRequest(add=add))

    def first_error_or_token(self) -> executor_pb2.ExecutorStep:
        return next(iter(self.call))

    def close(self) -> None:
        self._out.put(None)
        self.call.cancel()


def test_executor_rpcs_need_the_internal_token_and_health_stays_open(executor) -> None:
    with grpc.insecure_channel(executor.address) as channel:
        stub = executor_pb2_grpc.ExecutorStub(channel)
        for metadata in (None, ((INTERNAL_TOKEN_HEADER, "wrong"),)):
            with pytest.raises(grpc.RpcError) as info:
                stub.Info(executor_pb2.ExecutorInfoRequest(), timeout=5, metadata=metadata)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            session = Session(channel, metadata)
            session.add("x", 1, 4)
            with pytest.raises(grpc.RpcError) as info:
                session.first_error_or_token()
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert stub.Info(executor_pb2.ExecutorInfoRequest(), timeout=5, metadata=METADATA)
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
        assert health.status == health_pb2.HealthCheckResponse.SERVING


def test_a_session_past_its_sequence_cap_is_refused_and_another_session_is_not(executor):
    with grpc.insecure_channel(executor.address) as channel:
        greedy = Session(channel)
        greedy.add("a", 3, 200)
        greedy.add("b", 2, 4)  # 3 + 2 > 4
        refused = None
        for step in greedy.call:
            if step.errors:
                refused = step.errors[0]
                break
        assert refused is not None and refused.request_id == "b"
        assert refused.code == executor_pb2.REQUEST_ERROR_CODE_RESOURCE_EXHAUSTED
        assert "--max-seqs-per-session" in refused.message
        other = Session(channel)
        other.add("c", 4, 2)
        step = other.first_error_or_token()
        assert not step.errors and step.updates[0].request_id == "c"
        greedy.close()
        other.close()


def test_an_idle_executor_keeps_its_pool_alive_past_the_lease(blockmgr, executor) -> None:
    epoch = _pools(blockmgr)["trusted"]
    # No traffic: only the executor's keep-alives renew the lease. Without them the pool
    # would be gone a lease after its last call (found so at the next look, at most a quarter
    # lease later): a look one and a half leases on would not find it.
    time.sleep(1.5 * LEASE_S)
    assert _pools(blockmgr).get("trusted") == epoch


def test_a_stranger_cannot_take_the_executors_pool(blockmgr, executor) -> None:
    stranger = GrpcClient(blockmgr.address, internal_token=TOKEN)
    with pytest.raises(BlockManagerError, match="another owner"):
        stranger.register("trusted", PoolSpec(10**6, 16))
    stranger.close()


def test_shutdown_unregisters_and_a_killed_executors_pool_is_reclaimed(
    blockmgr, tiny_checkpoint
) -> None:
    model = str(tiny_checkpoint("llama"))
    graceful = _executor(model, blockmgr, "graceful")
    assert "graceful" in _pools(blockmgr)
    assert graceful.stop() == 0
    assert "graceful" not in _pools(blockmgr)  # unregistered on SIGTERM

    killed = _executor(model, blockmgr, "killed")
    assert "killed" in _pools(blockmgr)
    killed.proc.send_signal(signal.SIGKILL)
    killed.proc.wait(10)
    # Reclaimed once its lease has run out (LEASE_S after its last keep-alive).
    wait_until(lambda: "killed" not in _pools(blockmgr), what="the dead executor's pool reclaimed")
    killed.stop()


def test_a_restarted_executor_takes_its_pool_back_without_waiting_for_the_lease(
    tiny_checkpoint,
) -> None:
    patient = ServiceProcess(
        ["blockmgr", "--port", "0", "--internal-token", TOKEN, "--pool-lease-s", "600"],
        "blockmgr_listening",
    )
    try:
        model = str(tiny_checkpoint("llama"))
        first = _executor(model, patient, "phoenix")
        epoch = _pools(patient)["phoenix"]
        first.proc.send_signal(signal.SIGKILL)
        first.proc.wait(10)
        second = _executor(model, patient, "phoenix")  # ready means: registered, serving
        # Taken back at its first try: not refused as another owner's and retried until the
        # 600 s lease ran out (each retry is a blockmgr_unavailable warning).
        assert "blockmgr_unavailable" not in second.events()
        assert _pools(patient)["phoenix"] != epoch
        assert second.stop() == 0
        first.stop()
    finally:
        patient.stop()
