"""The gateway process: tokenizer, executor connections, the public gRPC server (health,
reflection, optional TLS and API key), the OpenAI-compatible HTTP server, and the Prometheus
endpoint."""

from __future__ import annotations

import asyncio
import functools
from pathlib import Path

import grpc
import structlog
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from pagedserve.v1 import generation_pb2, generation_pb2_grpc
from services.common.auth import SERVER_OPTIONS, api_key_interceptor
from services.common.gc_policy import freeze_startup_heap
from services.common.grpc_server import (
    MalformedRequestInterceptor,
    add_health_and_reflection,
    set_serving,
    stop_event,
)
from services.common.ports import bind_port
from services.gateway.api.grpc import AdaptersServicer, GenerationServicer
from services.gateway.api.openai.app import build_app
from services.gateway.core.adapters import AdapterService
from services.gateway.core.generation import GenerationCore
from services.gateway.core.metrics import GatewayMetrics
from services.gateway.fleet.executor_client import ExecutorPool
from services.gateway.fleet.kv_events import KVEventFollower
from services.gateway.fleet.prefix_index import PrefixIndex
from services.gateway.fleet.routing import Router, RoutingPolicy
from services.gateway.service.config import GatewayConfig
from services.gateway.service.http_server import HttpServer
from services.gateway.text.reasoning_parsers import PARSERS as REASONING_PARSERS
from services.gateway.text.tool_parsers import tool_call_parser

log = structlog.get_logger(__name__)
SERVICE_NAME = generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name


def load_tokenizer(model_dir: str) -> PreTrainedTokenizerBase:
    if not Path(model_dir).is_dir():
        raise FileNotFoundError(f"--model {model_dir!r} is not a directory")
    return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)


class GatewayServer:
    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        self.tokenizer = load_tokenizer(config.model)
        self.index: PrefixIndex | None = None
        self.events: KVEventFollower | None = None
        if config.blockmgr_address and config.routing == RoutingPolicy.PREFIX_AWARE:
            self.index = PrefixIndex()
            self.events = KVEventFollower(
                config.blockmgr_address, self.index, security=config.security
            )
        self.pool = ExecutorPool(
            config.executor_addresses,
            on_change=self._on_pool_change,
            security=config.security,
            executor_wait_s=config.executor_wait_s,
            dns=config.executor_dns,
            router=Router(config.routing, self.index, load_weight=config.routing_load_weight),
        )
        self.metrics = GatewayMetrics(
            lambda: [c.load for c in self.pool.connections if c.ready and c.load is not None],
            self._routing_state,
        )
        interceptors = [api_key_interceptor(config.api_key)] if config.api_key else []
        self.server = grpc.aio.server(
            interceptors=[*interceptors, MalformedRequestInterceptor()], options=SERVER_OPTIONS
        )
        self.core = GenerationCore(
            config.generation_settings(), self.tokenizer, self.pool, self.metrics
        )
        self.adapters = AdapterService(self.pool, config.allow_runtime_lora_updating)
        generation_pb2_grpc.add_GenerationServicer_to_server(
            GenerationServicer(self.core), self.server
        )
        generation_pb2_grpc.add_AdaptersServicer_to_server(
            AdaptersServicer(self.adapters), self.server
        )
        self.health = add_health_and_reflection(
            self.server, SERVICE_NAME, enable_reflection=config.enable_reflection
        )
        address = f"{config.host}:{config.port}"
        if config.tls_cert and config.tls_key:
            creds = grpc.ssl_server_credentials(
                [(Path(config.tls_key).read_bytes(), Path(config.tls_cert).read_bytes())]
            )
            bind = functools.partial(self.server.add_secure_port, address, creds)
        else:
            bind = functools.partial(self.server.add_insecure_port, address)
        self.port = bind_port(bind, config.host, config.port, "--port")
        self._health_task: asyncio.Task[None] | None = None
        self.http: HttpServer | None = None
        if config.http_port is not None:
            parser = config.tool_call_parser if config.enable_auto_tool_choice else None
            app = build_app(
                self.core,
                adapters=self.adapters,
                api_key=config.api_key,
                registry=self.metrics.registry,
                auto_tools=tool_call_parser(parser) if parser else None,
                reasoning=REASONING_PARSERS.get(config.reasoning_parser or ""),
            )
            self.http = HttpServer(
                app, config.host, config.http_port, drain_timeout_s=config.drain_timeout_s
            )

    def _routing_state(self) -> list[tuple[str, bool, int]]:
        """(executor, its KV events followed live, confirmed cached blocks) per executor."""
        index = self.index
        if index is None:
            return []
        return [
            (c.address, index.is_synced(c.info.pool_id), index.num_blocks(c.info.pool_id))
            for c in self.pool.connections
            if c.info is not None and c.info.pool_id
        ]

    def _on_pool_change(self) -> None:
        if self.events is not None:
            self.events.track(self.pool.pool_ids())
        serving = bool(self.pool.ready)
        log.info(
            "gateway_health", serving=serving, executors_ready=[c.address for c in self.pool.ready]
        )
        self._health_task = asyncio.ensure_future(self._set_health(serving))

    async def _set_health(self, serving: bool) -> None:
        await set_serving(self.health, SERVICE_NAME, serving)

    async def start(self) -> None:
        await self._set_health(False)
        if self.config.metrics_port is not None:
            port = self.metrics.serve(self.config.metrics_port, self.config.host)
            log.info("metrics_listening", metrics_port=port)
        self.pool.start()
        await self.server.start()
        if self.http is not None:
            http_port = await self.http.start()
            log.info("http_listening", host=self.config.host, http_port=http_port)
        log.info(
            "gateway_listening",
            host=self.config.host,
            port=self.port,
            tls=bool(self.config.tls_cert),
            auth=bool(self.config.api_key),
            executors=list(self.config.executor_addresses),
            executor_dns=self.config.executor_dns,
            routing=self.config.routing.value,
            blockmgr=self.config.blockmgr_address,
        )

    async def stop(self) -> None:
        """Drain: NOT_SERVING at once, no new RPC accepted, running streams finish within
        ``--drain-timeout-s``; then whatever still runs is cancelled (and aborted on its
        executor)."""
        await self.health.enter_graceful_shutdown()
        log.info(
            "gateway_draining",
            inflight=self.core.num_inflight,
            timeout_s=self.config.drain_timeout_s,
        )
        stopping = [self.server.stop(self.config.drain_timeout_s)]
        if self.http is not None:
            stopping.append(self.http.stop())
        await asyncio.gather(*stopping)
        await self.pool.close()
        if self.events is not None:
            await self.events.close()
        self.metrics.shutdown()
        log.info("gateway_stopped")


async def serve(config: GatewayConfig) -> int:
    server = GatewayServer(config)
    await server.start()
    log.info("gc_frozen", objects=freeze_startup_heap())
    await stop_event().wait()
    log.info("gateway_shutting_down")
    await server.stop()
    return 0
