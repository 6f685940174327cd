"""Prometheus metrics of the gateway, on their own registry and HTTP port.

Gateway-side observations (latencies, tokens, outcomes) are recorded as requests stream;
executor-side state (running / waiting sequences, KV usage, preemptions, prefix-cache hits)
is read from the latest ``ExecutorLoad`` of each executor at scrape time.

Routing, per executor: requests routed and by which policy, the prompt tokens routed, the
cached tokens the router predicted and those the executor actually reported
(``rate(pagedserve_routing_predicted_cached_tokens_total[5m]) /
rate(pagedserve_routing_prompt_tokens_total[5m])`` is the routing hit ratio), and the prefix
index's state (event stream live, confirmed blocks).
"""

from __future__ import annotations

import errno
import time
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from pagedserve.v1 import executor_pb2
from services.common.ports import PortInUseError

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)


# (label, ExecutorLoad field) of pagedserve_kv_tier_blocks_moved
_TIER_MOVES = (
    ("offload", "num_offloaded_blocks"),
    ("onboard", "num_onboarded_blocks"),
    ("spill", "num_spilled_blocks"),
    ("load", "num_loaded_blocks"),
    ("store", "num_stored_blocks"),
)


class _ExecutorCollector(Collector):
    def __init__(self, loads: Callable[[], list[executor_pb2.ExecutorLoad]]) -> None:
        self._loads = loads

    def collect(self) -> Iterable[GaugeMetricFamily | CounterMetricFamily]:
        loads = self._loads()
        running = sum(x.num_running for x in loads)
        waiting = sum(x.num_waiting for x in loads)
        usable = sum(x.num_usable_blocks for x in loads)
        free = sum(x.num_free_blocks for x in loads)
        prompt = sum(x.num_prompt_tokens for x in loads)
        cached = sum(x.num_cached_prompt_tokens for x in loads)
        yield GaugeMetricFamily(
            "pagedserve_num_requests_running", "Sequences running on the executors", value=running
        )
        yield GaugeMetricFamily(
            "pagedserve_num_requests_waiting", "Sequences waiting on the executors", value=waiting
        )
        yield GaugeMetricFamily(
            "pagedserve_kv_cache_usage_ratio",
            "Share of KV blocks in use (cached-free blocks count as free)",
            value=(1 - free / usable) if usable else 0.0,
        )
        yield GaugeMetricFamily(
            "pagedserve_prefix_cache_hit_ratio",
            "Prompt tokens served from the prefix cache / prompt tokens computed or cached",
            value=cached / (prompt + cached) if prompt + cached else 0.0,
        )
        yield CounterMetricFamily(
            "pagedserve_num_preemptions",
            "Sequences preempted (recomputed) by the executors",
            value=sum(x.num_preemptions for x in loads),
        )
        yield CounterMetricFamily(
            "pagedserve_executor_steps",
            "Scheduler steps run by the executors",
            value=sum(x.num_steps for x in loads),
        )
        yield CounterMetricFamily(
            "pagedserve_executor_steps_scheduled_ahead",
            "Steps whose block-manager round trip overlapped the previous forward "
            "(--async-scheduling)",
            value=sum(x.num_steps_ahead for x in loads),
        )
        moved = CounterMetricFamily(
            "pagedserve_kv_tier_blocks_moved",
            "KV blocks moved between the device and the host and disk tiers, by move: offload "
            "(device to host), onboard (host to device), spill (host to disk), load (disk to "
            "device), store (device to disk)",
            labels=["move"],
        )
        for move, field in _TIER_MOVES:
            moved.add_metric([move], sum(getattr(x, field) for x in loads))
        yield moved
        yield from _spec_metrics(loads)
        yield from _lora_metrics(loads)
        yield CounterMetricFamily(
            "pagedserve_kv_tier_failed_moves",
            "KV tier moves that failed (I/O errors): those blocks were uncached, nothing lost",
            value=sum(x.num_failed_moves for x in loads),
        )


def _lora_metrics(loads: list[executor_pb2.ExecutorLoad]) -> Iterable[GaugeMetricFamily]:
    """vLLM's ``lora_requests_info``: one sample whose labels name the adapters of the running
    and of the waiting requests (comma-separated, over the executors) and the slots per
    executor; its value is when it was taken. Nothing without LoRA."""
    if not any(x.max_loras for x in loads):
        return
    info = GaugeMetricFamily(
        "pagedserve_lora_requests_info",
        "Running and waiting LoRA adapters (labels); value: the time of the snapshot",
        labels=["running_lora_adapters", "waiting_lora_adapters", "max_lora"],
    )
    running = sorted({a for x in loads for a in x.running_lora_adapters})
    waiting = sorted({a for x in loads for a in x.waiting_lora_adapters})
    max_lora = str(max(x.max_loras for x in loads))
    info.add_metric([",".join(running), ",".join(waiting), max_lora], time.time())
    yield info


def _spec_metrics(loads: list[executor_pb2.ExecutorLoad]) -> Iterable[CounterMetricFamily]:
    """Speculative decoding, vLLM's counters (``spec_decode_*``) summed over the executors."""
    for name, field, doc in (
        ("num_drafts", "num_spec_drafts", "Sequence-steps that verified draft tokens"),
        ("num_draft_tokens", "num_spec_draft_tokens", "Draft tokens verified"),
        ("num_accepted_tokens", "num_spec_accepted_tokens", "Draft tokens accepted"),
    ):
        yield CounterMetricFamily(
            f"pagedserve_spec_decode_{name}", doc, value=sum(getattr(x, field) for x in loads)
        )
    per_pos = CounterMetricFamily(
        "pagedserve_spec_decode_num_accepted_tokens_per_pos",
        "Draft tokens accepted, by position in the draft (0: the first)",
        labels=["position"],
    )
    totals: list[int] = []
    for load in loads:
        for pos, count in enumerate(load.spec_accepted_per_pos):
            totals.extend([0] * (pos + 1 - len(totals)))
            totals[pos] += count
    for pos, count in enumerate(totals):
        per_pos.add_metric([str(pos)], count)
    yield per_pos


RoutingState = Callable[[], list[tuple[str, bool, int]]]  # (executor, events live, blocks)


class _RoutingCollector(Collector):
    def __init__(self, state: RoutingState) -> None:
        self._state = state

    def collect(self) -> Iterable[GaugeMetricFamily]:
        live = GaugeMetricFamily(
            "pagedserve_routing_kv_events_live",
            "1 while the executor's KV events are followed live from the block manager",
            labels=["executor"],
        )
        blocks = GaugeMetricFamily(
            "pagedserve_routing_index_blocks",
            "Cached blocks the prefix index knows on the executor (from KV events)",
            labels=["executor"],
        )
        for executor, synced, num_blocks in self._state():
            live.add_metric([executor], 1.0 if synced else 0.0)
            blocks.add_metric([executor], num_blocks)
        yield live
        yield blocks


class GatewayMetrics:
    def __init__(
        self,
        loads: Callable[[], list[executor_pb2.ExecutorLoad]],
        routing_state: RoutingState = list,
    ) -> None:
        r = self.registry = CollectorRegistry()
        r.register(_ExecutorCollector(loads))
        r.register(_RoutingCollector(routing_state))
        self.routed_requests = Counter(
            "pagedserve_routed_requests",
            "Requests sent to each executor, by the routing policy that chose it",
            ["executor", "policy"],
            registry=r,
        )
        self.routing_prompt_tokens = Counter(
            "pagedserve_routing_prompt_tokens",
            "Prompt tokens sent to each executor",
            ["executor"],
            registry=r,
        )
        self.routing_predicted_cached_tokens = Counter(
            "pagedserve_routing_predicted_cached_tokens",
            "Prompt tokens the router expected each executor to find in its prefix cache",
            ["executor"],
            registry=r,
        )
        self.routing_cached_tokens = Counter(
            "pagedserve_routing_cached_tokens",
            "Prompt tokens each executor reported served from its prefix cache",
            ["executor"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "pagedserve_prompt_tokens", "Prompt tokens of finished requests", registry=r
        )
        self.cached_prompt_tokens = Counter(
            "pagedserve_cached_prompt_tokens",
            "Prompt tokens served from the prefix cache",
            registry=r,
        )
        self.generation_tokens = Counter(
            "pagedserve_generation_tokens", "Tokens generated and streamed", registry=r
        )
        self.requests = Counter(
            "pagedserve_requests", "Finished requests by outcome", ["outcome"], registry=r
        )
        self.resumed = Counter(
            "pagedserve_requests_resumed",
            "Streams carried on from their tokens so far on another executor (or the same one "
            "restarted), by why their executor was lost",
            ["reason"],
            registry=r,
        )
        self.inflight = Gauge(
            "pagedserve_gateway_requests_inflight",
            "Generate streams open on this gateway (queued here or sent to an executor)",
            registry=r,
        )
        self.queued = Gauge(
            "pagedserve_gateway_requests_queued",
            "Requests waiting in the gateway for one of --max-concurrent-requests to end",
            registry=r,
        )
        self.ttft = Histogram(
            "pagedserve_time_to_first_token_seconds",
            "Time from request to its first token",
            registry=r,
            buckets=_LATENCY_BUCKETS,
        )
        self.itl = Histogram(
            "pagedserve_inter_token_latency_seconds",
            "Time between consecutive token messages of a sample",
            registry=r,
            buckets=_ITL_BUCKETS,
        )
        self.e2e = Histogram(
            "pagedserve_e2e_request_latency_seconds",
            "Time from request to its final message",
            registry=r,
            buckets=_LATENCY_BUCKETS,
        )
        self.port: int | None = None
        self._server: Any = None  # the prometheus-client WSGI server, once serving

    def serve(self, port: int, host: str = "0.0.0.0") -> int:
        """Serve ``/metrics`` on ``host:port``; a port another process holds raises
        :class:`~services.common.ports.PortInUseError` naming ``--metrics-port``."""
        try:
            server, _thread = start_http_server(port, addr=host, registry=self.registry)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise PortInUseError(port, "--metrics-port") from None
            raise
        self._server = server
        self.port = server.server_port
        return self.port

    def shutdown(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server = None
