"""Prefix-aware routing through real processes: a block manager, two executors and a gateway
that follows the block manager's KV events. Requests repeating a prefix go where it is
cached, the router's predictions match what the executors report, and a block-manager restart
(new epochs, CLEARED) resets the index instead of leaving stale predictions."""

from __future__ import annotations

import signal
import urllib.request
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pagedserve.testing.procs import (
    ServiceProcess,
    executor_args,
    gateway_args,
    wait_serving,
    wait_until,
)
from pagedserve.v1 import generation_pb2 as G
from pagedserve.v1 import generation_pb2_grpc

BLOCK = 16
PREFIXES = [[(7 * p + i) % 200 + 10 for i in range(3 * BLOCK)] for p in range(3)]


@dataclass
class Cluster:
    bm_port: int
    blockmgr: ServiceProcess
    executors: list[ServiceProcess]
    gateway: ServiceProcess
    metrics_port: int

    def metrics(self) -> dict[str, dict[tuple[str, ...], float]]:
        """Samples by name, keyed by their label values."""
        body = urllib.request.urlopen(
            f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=30
        ).read()
        out: dict[str, dict[tuple[str, ...], float]] = defaultdict(dict)
        for family in text_string_to_metric_families(body.decode()):
            for s in family.samples:
                out[s.name][tuple(s.labels.values())] = s.value
        return out

    def total(self, name: str) -> float:
        return sum(self.metrics().get(name, {}).values())

    def wait_events_live(self) -> None:
        def live() -> bool:
            live = self.metrics().get("pagedserve_routing_kv_events_live", {})
            return len(live) == len(self.executors) and all(v == 1.0 for v in live.values())

        wait_until(live, what="every executor's KV events followed live", interval=0.1)

    def generate(self, prompt: list[int]) -> int:
        """Cached prompt tokens the executor reported for this request."""
        stub = generation_pb2_grpc.GenerationStub(grpc.insecure_channel(self.gateway.address))
        request = G.GenerateRequest(
            prompt_token_ids=G.TokenIds(ids=prompt),
            sampling_params=G.SamplingParams(max_tokens=3, temperature=0, ignore_eos=True),
        )
        final = list(stub.Generate(request, timeout=60))[-1]
        return final.usage.cached_prompt_tokens


@pytest.fixture(scope="module")
def cluster(tiny_model_dir: Path) -> Iterator[Cluster]:
    # Ports the services bound themselves (one found free beforehand may be taken by then on a
    # busy machine); a restarted block manager comes back on its own.
    procs: list[ServiceProcess] = []
    try:
        procs.append(ServiceProcess(["blockmgr", "--port", "0"], "blockmgr_listening"))
        bm_port = procs[0].port
        assert bm_port is not None
        bm = f"127.0.0.1:{bm_port}"
        for name in ("route-a", "route-b"):
            args = executor_args(tiny_model_dir, bm, "--pool-id", name, "--block-size", "16")
            procs.append(ServiceProcess(args, "executor_ready"))
        gateway_extra: list[str] = ["--blockmgr-address", bm, "--metrics-port", "0"]
        for ex in procs[2:]:
            gateway_extra += ["--executor", ex.address]
        gateway = ServiceProcess(
            gateway_args(tiny_model_dir, procs[1].address, *gateway_extra), "gateway_listening"
        )
        procs.append(gateway)
        metrics_port = int(gateway.wait_for_event("metrics_listening")["metrics_port"])
        wait_serving(gateway.address)
        cluster = Cluster(bm_port, procs[0], procs[1:3], gateway, metrics_port)
        yield cluster
        procs[0] = cluster.blockmgr  # a test may have replaced it
    finally:
        for p in reversed(procs):
            p.stop()


def test_repeated_prefixes_go_where_they_are_cached_and_predictions_match(
    cluster: Cluster,
) -> None:
    cluster.wait_events_live()
    cached: list[list[int]] = []
    for round_ in range(3):
        cached.append([cluster.generate([*p, 300 + round_, 301, 302]) for p in PREFIXES])
    # Three prefixes over two executors: a router blind to the cache (alternating) would
    # send a prefix back where it is not cached; this one always finds it.
    assert cached[0] == [0, 0, 0]
    assert cached[1] == cached[2] == [3 * BLOCK] * 3
    m = cluster.metrics()
    routed = m["pagedserve_routed_requests_total"]
    assert sum(routed.values()) == 9
    assert {labels[1] for labels in routed} == {"prefix-aware"}
    assert len({labels[0] for labels in routed}) == 2  # both executors took prefixes
    predicted = sum(m["pagedserve_routing_predicted_cached_tokens_total"].values())
    actual = sum(m["pagedserve_routing_cached_tokens_total"].values())
    assert predicted == actual == 6 * 3 * BLOCK
    blocks = m["pagedserve_routing_index_blocks"]
    assert sum(blocks.values()) >= 3 * 3  # every prefix's 3 blocks, confirmed by events


def test_a_block_manager_restart_clears_the_index_and_routing_recovers(cluster: Cluster) -> None:
    cluster.wait_events_live()
    cluster.blockmgr.proc.send_signal(signal.SIGKILL)
    cluster.blockmgr.proc.wait(10)
    cluster.blockmgr = ServiceProcess(
        ["blockmgr", "--port", str(cluster.bm_port)], "blockmgr_listening"
    )
    wait_serving(cluster.gateway.address, timeout=30)
    cluster.wait_events_live()
    # Each executor re-registered (a new epoch, CLEARED): nothing is predicted as cached.
    assert cluster.total("pagedserve_routing_index_blocks") == 0
    before = cluster.total("pagedserve_routing_predicted_cached_tokens_total")
    prompt = [*PREFIXES[0], 400]
    assert cluster.generate(prompt) == 0
    assert cluster.total("pagedserve_routing_predicted_cached_tokens_total") == before
    assert cluster.generate(prompt) == 3 * BLOCK
    after = cluster.total("pagedserve_routing_predicted_cached_tokens_total")
    assert after - before == 3 * BLOCK
