"""Configuration of the gateway (frozen; parsed once in the entry point)."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field

from services.common.auth import InternalSecurity
from services.gateway.core.settings import PROMPT_BYTES_PER_TOKEN, GenerationSettings
from services.gateway.fleet.routing import DEFAULT_LOAD_WEIGHT, RoutingPolicy
from services.gateway.text.reasoning_parsers import PARSERS as REASONING_PARSERS
from services.gateway.text.tool_parsers import PARSERS


@dataclass(frozen=True)
class GatewayConfig:
    model: str  # checkpoint directory: the gateway reads its tokenizer and chat template
    executor_addresses: tuple[str, ...] = ("127.0.0.1:50061",)
    executor_dns: str | None = None  # name:port resolved every few seconds (k8s headless)
    blockmgr_address: str | None = None  # its KV events feed prefix-aware routing
    routing: RoutingPolicy = RoutingPolicy.LEAST_LOADED
    routing_load_weight: float = DEFAULT_LOAD_WEIGHT
    host: str = "0.0.0.0"
    port: int = 50051
    max_concurrent_requests: int = 1024  # sent to the executors at once (they queue too)
    max_queued_requests: int = 4096  # then wait in the gateway; beyond both: refused
    max_n: int = 16
    max_prompt_bytes: int | None = None  # default: PROMPT_BYTES_PER_TOKEN x max_model_len
    tokenizer_workers: int = 2  # threads that tokenize and apply chat templates
    executor_wait_s: float = 30.0  # streams wait this long for a non-serving executor
    max_resumes: int = 2  # a stream whose executor is lost is carried on elsewhere this often
    drain_timeout_s: float = 30.0  # on SIGTERM, running streams get this long to finish
    api_key: str | None = field(default=None, repr=False)
    tls_cert: str | None = None
    tls_key: str | None = None
    metrics_port: int | None = 9090  # None: no metrics endpoint
    http_port: int | None = 8000  # the OpenAI-compatible HTTP API; None: off, 0: a free port
    enable_reflection: bool = True
    served_model_name: str | None = None
    # Chat tool_choice "auto" (OpenAI's default with tools): the model's calls read by the
    # parser for its family (vLLM's --enable-auto-tool-choice, --tool-call-parser).
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    # A thinking model's reasoning apart from its answer (chat's reasoning_content).
    reasoning_parser: str | None = None
    # Load and unload LoRA adapters at runtime (vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING).
    allow_runtime_lora_updating: bool = False
    security: InternalSecurity = field(default_factory=InternalSecurity)
    log_level: str = "INFO"

    @classmethod
    def parser(cls) -> argparse.ArgumentParser:
        p = argparse.ArgumentParser(
            prog="pagedserve gateway",
            description="Run the public gRPC API (pagedserve.v1.Generation) in front of executors.",
        )
        a = p.add_argument
        a("--model", required=True, help="checkpoint directory (tokenizer, chat template)")
        a(
            "--executor",
            action="append",
            dest="executor_addresses",
            default=None,
            help="executor host:port; repeat for several (default 127.0.0.1:50061)",
        )
        a(
            "--executor-dns",
            default=None,
            help="name:port whose every address is an executor, re-resolved every 5 s "
            "(a Kubernetes headless Service); executors that appear are connected, those "
            "that disappear are drained",
        )
        a(
            "--blockmgr-address",
            default=None,
            help="the block manager (host:port) whose KV events tell which executor caches "
            "which prefix (enables --routing prefix-aware)",
        )
        a(
            "--routing",
            choices=[p.value for p in RoutingPolicy],
            default=None,
            help="how requests pick an executor (default: prefix-aware with "
            "--blockmgr-address, else least-loaded)",
        )
        a(
            "--routing-load-weight",
            type=float,
            default=cls.routing_load_weight,
            help="prefix-aware score = cached prefix tokens - weight x (running + waiting "
            "tokens) of the executor (default %(default)s)",
        )
        a("--host", default=cls.host)
        a("--port", type=int, default=cls.port)
        a(
            "--max-concurrent-requests",
            type=int,
            default=cls.max_concurrent_requests,
            help="requests sent to the executors at once, all executors together; each runs "
            "up to its --max-num-seqs of them and queues the rest in priority order (keep "
            "this within the executors' --max-seqs-per-session, or they refuse the excess "
            "with 429 / RESOURCE_EXHAUSTED). Requests beyond it wait in the gateway, first "
            "come first served: see --max-queued-requests (default %(default)s)",
        )
        a(
            "--max-queued-requests",
            type=int,
            default=cls.max_queued_requests,
            help="requests that may wait in the gateway for one of --max-concurrent-requests "
            "to end; a request arriving when both are full is refused at once (HTTP 429, "
            "gRPC RESOURCE_EXHAUSTED); 0 refuses as soon as --max-concurrent-requests are "
            "open. A waiting request whose client leaves gives up its place "
            "(default %(default)s)",
        )
        a("--max-n", type=int, default=cls.max_n, help="largest n (parallel samples) accepted")
        a(
            "--max-prompt-bytes",
            type=int,
            default=None,
            help="refuse longer prompts (text or chat messages) before tokenizing them "
            f"(default {PROMPT_BYTES_PER_TOKEN} x the executor's max_model_len)",
        )
        a(
            "--allow-runtime-lora-updating",
            action="store_true",
            help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (and the gRPC "
            "Adapters.LoadAdapter / UnloadAdapter): anyone with the API key may then load "
            "adapters from the executors' disks",
        )
        a(
            "--executor-wait-s",
            type=float,
            default=cls.executor_wait_s,
            help="running streams wait this long for an executor that stopped serving, then "
            "fail UNAVAILABLE (default %(default)s)",
        )
        a(
            "--max-resumes",
            type=int,
            default=cls.max_resumes,
            help="times a stream whose executor is lost (killed, or not serving for "
            "--executor-wait-s) is resumed on a serving one, from the tokens already sent; "
            "0: it fails UNAVAILABLE (default %(default)s)",
        )
        a(
            "--drain-timeout-s",
            type=float,
            default=cls.drain_timeout_s,
            help="on SIGTERM, running streams get this long to finish before they are "
            "cancelled (default %(default)s)",
        )
        a(
            "--tokenizer-workers",
            type=int,
            default=cls.tokenizer_workers,
            help="threads tokenizing prompts off the event loop (default %(default)s)",
        )
        a(
            "--api-key",
            default=os.environ.get("PAGEDSERVE_API_KEY"),
            help="require `authorization: Bearer <key>` (also PAGEDSERVE_API_KEY)",
        )
        a("--tls-cert", default=None, help="PEM certificate chain (enables TLS with --tls-key)")
        a("--tls-key", default=None, help="PEM private key")
        a(
            "--metrics-port",
            type=int,
            default=cls.metrics_port,
            help="Prometheus /metrics HTTP port; 0 picks a free one; -1 disables",
        )
        a(
            "--http-port",
            type=int,
            default=cls.http_port,
            help="OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, ...) port "
            "on --host; 0 picks a free one; -1 disables (default %(default)s)",
        )
        a("--no-reflection", dest="enable_reflection", action="store_false")
        a("--served-model-name", default=None)
        a(
            "--enable-auto-tool-choice",
            action="store_true",
            help='chat tool_choice "auto" (the default with tools): the model decides between '
            "text and tool calls, read from its output by --tool-call-parser",
        )
        a(
            "--tool-call-parser",
            default=None,
            choices=sorted(PARSERS),
            help="the tool-call format of the model's family: hermes (Qwen2.5, Qwen3, Hermes), "
            "llama3_json (Llama 3.1+)",
        )
        a(
            "--reasoning-parser",
            default=None,
            choices=sorted(REASONING_PARSERS),
            help="a thinking model's format: chat replies carry its reasoning apart, as "
            "reasoning_content: qwen3 (<think> written by the model), deepseek_r1 (opened by "
            "the template)",
        )
        a("--log-level", default=cls.log_level)
        InternalSecurity.add_args(p)
        return p

    @classmethod
    def from_args(cls, argv: list[str]) -> GatewayConfig:
        p = cls.parser()
        ns = vars(p.parse_args(argv))
        default = () if ns["executor_dns"] else cls.executor_addresses
        ns["executor_addresses"] = tuple(ns["executor_addresses"] or default)
        ns["security"] = InternalSecurity.from_namespace(ns)
        if ns["routing"] is None:
            prefix = ns["blockmgr_address"] is not None
            ns["routing"] = RoutingPolicy.PREFIX_AWARE if prefix else RoutingPolicy.LEAST_LOADED
        ns["routing"] = RoutingPolicy(ns["routing"])
        for port in ("metrics_port", "http_port"):
            if ns[port] is not None and ns[port] < 0:
                ns[port] = None
        try:
            config = cls(**ns)
            config.validate()
        except ValueError as exc:
            p.error(str(exc))
        return config

    def generation_settings(self) -> GenerationSettings:
        """The part of this configuration the generation core reads."""
        return GenerationSettings(
            model_name=self.served_model_name or self.model.rstrip("/").split("/")[-1],
            max_concurrent_requests=self.max_concurrent_requests,
            max_queued_requests=self.max_queued_requests,
            max_n=self.max_n,
            max_prompt_bytes=self.max_prompt_bytes,
            tokenizer_workers=self.tokenizer_workers,
            executor_wait_s=self.executor_wait_s,
            max_resumes=self.max_resumes,
        )

    def validate(self) -> None:
        if not self.executor_addresses and not self.executor_dns:
            raise ValueError("at least one --executor (or --executor-dns) is needed")
        if self.executor_dns is not None:
            host, _, port = self.executor_dns.rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"--executor-dns must be name:port, got {self.executor_dns!r}")
        if self.routing == RoutingPolicy.PREFIX_AWARE and not self.blockmgr_address:
            raise ValueError("--routing prefix-aware needs --blockmgr-address")
        if self.routing_load_weight < 0:
            raise ValueError("--routing-load-weight must be >= 0")
        if self.max_concurrent_requests < 1:
            raise ValueError("--max-concurrent-requests must be >= 1")
        if self.max_queued_requests < 0:
            raise ValueError("--max-queued-requests must be >= 0")
        if self.max_n < 1:
            raise ValueError("--max-n must be >= 1")
        if self.max_prompt_bytes is not None and self.max_prompt_bytes < 1:
            raise ValueError("--max-prompt-bytes must be >= 1")
        if self.executor_wait_s <= 0:
            raise ValueError("--executor-wait-s must be > 0")
        if self.max_resumes < 0:
            raise ValueError("--max-resumes must be >= 0")
        if self.drain_timeout_s < 0:
            raise ValueError("--drain-timeout-s must be >= 0")
        if self.tokenizer_workers < 1:
            raise ValueError("--tokenizer-workers must be >= 1")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
        if self.tool_call_parser is not None and self.tool_call_parser not in PARSERS:
            raise ValueError(f"--tool-call-parser must be one of {', '.join(sorted(PARSERS))}")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(
                f"--reasoning-parser must be one of {', '.join(sorted(REASONING_PARSERS))}"
            )
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("--tls-cert and --tls-key go together")
        if self.api_key is not None and not self.api_key:
            raise ValueError("--api-key must not be empty")
        self.security.validate()
