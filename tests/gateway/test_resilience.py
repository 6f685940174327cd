"""The gateway follows its executor's health: with the block manager down, new requests are
refused at once, running ones wait ``--executor-wait-s`` and then fail UNAVAILABLE, each
counted once; when the block manager is back, the stack serves again within seconds."""

from __future__ import annotations

import signal
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagedserve.testing.procs import (
    ServiceProcess,
    executor_args,
    gateway_args,
    wait_serving,
    wait_until,
)
from pagedserve.v1 import generation_pb2 as G
from pagedserve.v1 import generation_pb2_grpc
from services.common.healthcheck import check


def _health(address: str) -> str:
    """The health status ``address`` reports (a slow answer is waited for, not taken as
    NOT_SERVING)."""
    return check(address, timeout=30)[1]


def _requests_total(metrics_port: int) -> dict[str, float]:
    body = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=30).read()
    out = {}
    for line in body.decode().splitlines():
        if line.startswith("pagedserve_requests_total{"):
            outcome = line.split('outcome="')[1].split('"')[0]
            out[outcome] = float(line.split()[-1])
    return out


def test_block_manager_outage_is_seen_at_the_gateway_and_healed(tiny_model_dir: Path) -> None:
    # Ports the services bound themselves (one found free beforehand may be taken by then on
    # a busy machine); the block manager comes back on its own.
    blockmgr = ServiceProcess(["blockmgr", "--port", "0"], "blockmgr_listening")
    bm_port = blockmgr.port
    executor = ServiceProcess(executor_args(tiny_model_dir, blockmgr.address), "executor_ready")
    extra = ("--executor-wait-s", "2", "--metrics-port", "0")  # the last wins
    gateway = ServiceProcess(
        gateway_args(tiny_model_dir, executor.address, *extra), "gateway_listening"
    )
    metrics_port = int(gateway.wait_for_event("metrics_listening")["metrics_port"])
    revived = None
    try:
        wait_serving(gateway.address)
        stub = generation_pb2_grpc.GenerationStub(grpc.insecure_channel(gateway.address))
        request = G.GenerateRequest(
            prompt="Hello", sampling_params=G.SamplingParams(max_tokens=4, temperature=0)
        )
        assert len(list(stub.Generate(request, timeout=30))) >= 1
        before = _requests_total(metrics_port)

        # The request that meets the outage: running when the block manager goes, then held
        # while the executor waits for it, then failed once --executor-wait-s has passed. (Sent
        # after the kill, it could come after the executor saw the outage: refused at once.)
        outcome: dict[str, object] = {}
        tokens: list[int] = []
        streaming = threading.Event()
        long_request = G.GenerateRequest(
            prompt="Hello",
            sampling_params=G.SamplingParams(max_tokens=240, temperature=0, ignore_eos=True),
        )

        def stranded() -> None:
            t0 = time.monotonic()
            try:
                for r in stub.Generate(long_request, timeout=60):
                    tokens.extend(r.token_ids)
                    streaming.set()
                outcome["code"] = grpc.StatusCode.OK
            except grpc.RpcError as exc:
                outcome["code"], outcome["details"] = exc.code(), exc.details()
            outcome["after_s"] = time.monotonic() - t0
            streaming.set()

        t = threading.Thread(target=stranded)
        t.start()
        assert streaming.wait(60)
        blockmgr.proc.send_signal(signal.SIGKILL)
        blockmgr.proc.wait(10)
        # The gateway follows the executor's NOT_SERVING.
        wait_until(lambda: _health(gateway.address) == "NOT_SERVING", what="gateway NOT_SERVING")
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(request, timeout=30))
        # Refused at once (no executor to send it to), not held like the stranded one until
        # --executor-wait-s or its deadline ran out.
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "no executor is serving" in info.value.details()
        assert "retry" in info.value.details()
        t.join(60)
        # Held --executor-wait-s (2 s) from when the executor stopped serving, then failed by
        # the gateway (not by its deadline).
        assert outcome["code"] == grpc.StatusCode.UNAVAILABLE, outcome
        assert "--executor-wait-s" in str(outcome["details"])
        assert float(outcome["after_s"]) > 1.5  # type: ignore[arg-type]
        assert 0 < len(tokens) < 240  # stranded mid-stream

        revived = ServiceProcess(["blockmgr", "--port", str(bm_port)], "blockmgr_listening")
        wait_serving(gateway.address, timeout=60)
        # Serving again within a second of its return on an idle machine: the executor retried
        # the block manager at least every half second all along (no growing back-off).
        retries = [
            r["retry_in_s"] for r in executor.lines if r.get("event") == "blockmgr_unavailable"
        ]
        assert retries and max(retries) <= 0.5, retries
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
