"""The gateway follows its executor's health: with the block manager down, new requests are
refused at once, running ones wait ``--executor-wait-s`` and then fail UNAVAILABLE, each
counted once; when the block manager is back, the stack serves again within seconds."""

from __future__ import annotations

import signal
import socket
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagedserve.v1 import generation_pb2 as G
from pagedserve.v1 import generation_pb2_grpc
from services.common.healthcheck import check
from tests.procs import ServiceProcess, executor_args, gateway_args, wait_serving


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serving(address: str) -> bool:
    return check(address, timeout=1.0)[0]


def _requests_total(metrics_port: int) -> dict[str, float]:
    body = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read()
    out = {}
    for line in body.decode().splitlines():
        if line.startswith("pagedserve_requests_total{"):
            outcome = line.split('outcome="')[1].split('"')[0]
            out[outcome] = float(line.split()[-1])
    return out


@pytest.mark.slow
def test_block_manager_outage_is_seen_at_the_gateway_and_healed(tiny_model_dir: Path) -> None:
    bm_port, metrics_port = _free_port(), _free_port()
    blockmgr = ServiceProcess(["blockmgr", "--port", str(bm_port)], "blockmgr_listening")
    executor = ServiceProcess(
        executor_args(tiny_model_dir, f"127.0.0.1:{bm_port}"), "executor_ready"
    )
    extra = ("--executor-wait-s", "2", "--metrics-port", str(metrics_port))  # the last wins
    gateway = ServiceProcess(
        gateway_args(tiny_model_dir, executor.address, *extra), "gateway_listening"
    )
    revived = None
    try:
        wait_serving(gateway.address)
        stub = generation_pb2_grpc.GenerationStub(grpc.insecure_channel(gateway.address))
        request = G.GenerateRequest(
            prompt="Hello", sampling_params=G.SamplingParams(max_tokens=4, temperature=0)
        )
        assert len(list(stub.Generate(request, timeout=30))) >= 1
        before = _requests_total(metrics_port)

        blockmgr.proc.send_signal(signal.SIGKILL)
        blockmgr.proc.wait(10)
        # The request that meets the outage: accepted, then held while the executor waits for
        # its block manager, then failed once --executor-wait-s has passed.
        outcome: dict[str, object] = {}

        def stranded() -> None:
            t0 = time.monotonic()
            try:
                list(stub.Generate(request, timeout=30))
                outcome["code"] = grpc.StatusCode.OK
            except grpc.RpcError as exc:
                outcome["code"], outcome["details"] = exc.code(), exc.details()
            outcome["after_s"] = time.monotonic() - t0

        t = threading.Thread(target=stranded)
        t.start()
        deadline = time.monotonic() + 10
        while _serving(gateway.address):  # the gateway follows the executor's NOT_SERVING
            assert time.monotonic() < deadline, "the gateway stayed SERVING"
            time.sleep(0.05)
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(request, timeout=30))
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE and "retry" in info.value.details()
        assert time.monotonic() - t0 < 1.0  # refused at once, not held until the deadline
        t.join(20)
        assert outcome["code"] == grpc.StatusCode.UNAVAILABLE, outcome
        assert "--executor-wait-s" in str(outcome["details"])
        assert 1.5 < float(outcome["after_s"]) < 10  # type: ignore[arg-type]

        revived = ServiceProcess(["blockmgr", "--port", str(bm_port)], "blockmgr_listening")
        back = time.monotonic()
        wait_serving(gateway.address, timeout=20)
        healed_s = time.monotonic() - back
        assert healed_s < 5, f"serving again took {healed_s:.1f} s"
        assert len(list(stub.Generate(request, timeout=30))) >= 1
        after = _requests_total(metrics_port)
        # Each request counted exactly once: two UNAVAILABLE, one more success.
        assert after.get("unavailable", 0) - before.get("unavailable", 0) == 2
        assert sum(after.values()) - sum(before.values()) == 3
        with grpc.insecure_channel(gateway.address) as ch:
            health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest())
            assert health.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        gateway.stop()
        executor.stop()
        (revived or blockmgr).stop()
