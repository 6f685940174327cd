"""Executor discovery by DNS: executors that appear are connected, those that disappear are
drained (no new requests, closed once their streams are done), configured ones stay; and a
gateway given ``--executor-dns`` serves through what the name resolves to."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc

from pagedserve.testing.procs import (
    ServiceProcess,
    async_wait_until,
    executor_args,
    gateway_args,
    wait_serving,
)
from pagedserve.v1 import generation_pb2 as G
from pagedserve.v1 import generation_pb2_grpc
from services.gateway.fleet.executor_client import ExecutorPool


def test_discovered_executors_join_and_departed_ones_drain_then_close() -> None:
    answers = [{"10.0.0.1:50061", "10.0.0.2:50061"}, {"10.0.0.2:50061", "10.0.0.3:50061"}]

    async def resolver(host: str, port: int) -> set[str]:
        assert (host, port) == ("executor", 50061)
        return answers[0] if len(answers) == 1 else answers.pop(0)

    async def scenario() -> None:
        pool = ExecutorPool(
            ("127.0.0.1:1",), dns="executor:50061", dns_interval_s=0.05, resolver=resolver
        )
        pool.start()
        try:
            # Two resolutions: .1 joins, then leaves (nothing runs on it) as .3 joins.
            expected = {"127.0.0.1:1", "10.0.0.2:50061", "10.0.0.3:50061"}
            await async_wait_until(
                lambda: {c.address for c in pool.connections} == expected,
                what="the second resolution's executors",
            )
            assert not any(c.draining for c in pool.connections)
            # A stream still running on a departing executor keeps it until it is done.
            pool.reconcile({"10.0.0.3:50061"})
            (leaving,) = [c for c in pool.connections if c.address == "10.0.0.2:50061"]
            assert leaving.draining and leaving not in pool.ready
        finally:
            await pool.close()

    asyncio.run(scenario())


def test_a_draining_executor_waits_for_its_streams() -> None:
    async def scenario() -> None:
        async def resolver(host: str, port: int) -> set[str]:
            return set()

        pool = ExecutorPool((), dns="x:1", dns_interval_s=3600, resolver=resolver)
        pool.reconcile({"10.0.0.9:1"})
        (conn,) = pool.connections
        conn._inflight["busy"] = asyncio.Queue()  # one stream in flight
        pool.reconcile(set())
        await asyncio.sleep(0.5)  # a few of its 0.2 s checks on an idle machine
        assert conn.draining and conn in pool.connections  # kept while the stream runs
        del conn._inflight["busy"]
        await async_wait_until(lambda: conn not in pool.connections, what="closed once idle")
        await pool.close()

    asyncio.run(scenario())


def test_gateway_serves_through_the_executors_a_name_resolves_to(tiny_model_dir: Path, stack):
    executor = ServiceProcess(
        executor_args(tiny_model_dir, stack.blockmgr.address, "--pool-id", "dns-discovered"),
        "executor_ready",
    )
    args = gateway_args(tiny_model_dir, "unused:1", "--executor-dns", f"localhost:{executor.port}")
    args.remove("--executor")
    args.remove("unused:1")
    gateway = ServiceProcess(args, "gateway_listening")
    try:
        wait_serving(gateway.address, timeout=30)
        stub = generation_pb2_grpc.GenerationStub(grpc.insecure_channel(gateway.address))
        req = G.GenerateRequest(
            prompt="Hello", sampling_params=G.SamplingParams(max_tokens=4, temperature=0)
        )
        assert sum(len(r.token_ids) for r in stub.Generate(req, timeout=30)) == 4
        assert "executor_discovered" in gateway.events()
    finally:
        assert gateway.stop() == 0
        executor.stop()
