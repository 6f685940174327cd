"""The executor's configuration: one frozen dataclass whose flags mirror vLLM's."""

from __future__ import annotations

import argparse
import enum
import math
import os
from dataclasses import dataclass, field
from typing import TypeVar

from services.blockmgr.api.types import EvictionPolicyName
from services.common.auth import InternalSecurity
from services.executor.core.pooling import PoolerConfig
from services.executor.core.spec.config import SpeculativeConfig
from services.executor.model.runner_config import (
    KV_CACHE_DTYPE_NAMES,
    QUANTIZATION_METHODS,
    CacheConfig,
    RunnerConfig,
)
from services.executor.service.lora_config import LoRAConfig
from services.executor.service.tier_flags import add_tier_args


def _parse_bytes(text: str) -> int:
    """``"512MiB"``, ``"2GiB"``, ``"1e9"`` or a plain integer of bytes."""
    units = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "kb": 10**3, "mb": 10**6, "gb": 10**9}
    t = text.strip().lower()
    for suffix, mult in units.items():
        if t.endswith(suffix):
            return int(float(t[: -len(suffix)]) * mult)
    return int(float(t))


def _parse_sizes(text: str) -> tuple[int, ...]:
    """``"1,2,4,8"`` -> ``(1, 2, 4, 8)``."""
    return tuple(sorted({int(t) for t in text.replace(" ", "").split(",") if t}))


class BlockManagerMode(enum.StrEnum):
    """Where the executor's block manager runs."""

    INPROC = "inproc"  # inside the executor process
    GRPC = "grpc"  # a block manager service, at --blockmgr-address


_E = TypeVar("_E", bound=enum.StrEnum)


def _enum(kind: type[_E], value: str) -> _E:
    try:
        return kind(value)
    except ValueError:
        raise ValueError(f"{value!r} is not one of {[v.value for v in kind]}") from None


@dataclass(frozen=True)
class ExecutorConfig:
    model: str
    dtype: str = "auto"
    device: str = "auto"  # auto: cuda if available, else cpu
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    gpu_memory_utilization: float = 0.9
    kv_cache_memory: int | None = None  # bytes of KV cache (CPU default 256 MiB)
    num_kv_blocks: int | None = None  # exact block count override (tests, experiments)
    # Keep every block of every layer in a model with sliding-window and full-attention layers
    # (vLLM's flag), instead of KV-cache groups whose sliding layers give blocks back.
    disable_hybrid_kv_cache_manager: bool = False
    # GiB of host memory for the block manager's host tier (vLLM's --kv-offloading-size):
    # blocks evicted from the KV cache are offloaded there, and onboarded on a prefix hit.
    kv_offloading_size: float = 0.0
    kv_offloading_backend: str = "native"
    # A disk tier below the host tier: GiB of one file under this directory.
    kv_offloading_disk_path: str | None = None
    kv_offloading_disk_size: float = 0.0
    # The order the host and disk tiers reuse their cached slots.
    kv_offloading_eviction_policy: EvictionPolicyName = EvictionPolicyName.LRU
    # How a sequence is preempted when the KV cache runs out (vLLM's --preemption-mode):
    # recompute (its blocks freed, its tokens computed again) or swap (its blocks copied to
    # the host tier and back; needs --kv-offloading-size).
    preemption_mode: str = "recompute"
    eviction_policy: EvictionPolicyName = EvictionPolicyName.LRU
    blockmgr: BlockManagerMode = BlockManagerMode.INPROC  # grpc: at blockmgr_address
    blockmgr_address: str | None = None
    pool_id: str | None = None  # default: derived from host and port
    watermark: float = 0.01  # share of blocks admissions keep free
    # Share of the KV blocks session pins (a request's kv_pin_ttl_s) may keep once free.
    session_pin_budget: float = 0.1
    quantization: str | None = None  # int8, bf16, fp16: the decoder's projections (CPU, fp32)
    kv_cache_dtype: str = "auto"  # vLLM's: auto (the model's), bfloat16, fp8*, int8*
    calculate_kv_scales: bool = False  # an fp8 cache's scales from a calibration prefill
    seed: int = 0
    host: str = "127.0.0.1"
    port: int = 50061
    served_model_name: str | None = None
    security: InternalSecurity = field(default_factory=InternalSecurity)
    lora: LoRAConfig = field(default_factory=LoRAConfig)  # multi-LoRA serving
    max_seqs_per_session: int = 1024  # sequences one gateway session may hold at once
    enforce_eager: bool = False  # no CUDA graphs: every step runs eagerly
    async_scheduling: bool = False  # the next Step's round trip overlaps this forward
    # Speculative decoding, vLLM's JSON: {"method": "ngram", "num_speculative_tokens": 3, ...}
    speculative_config: str | None = None
    # "generate" (sampling) or "pooling" (embeddings: one vector a prompt; vLLM's --runner),
    # and how it pools, vLLM's JSON: {"pooling_type": "LAST" | "MEAN" | "CLS", "normalize"}.
    runner: str = "generate"
    pooler_config: str | None = None
    cuda_graph_sizes: tuple[int, ...] | None = None  # decode batch sizes to capture
    tensor_parallel_size: int = 1  # ranks the model is sharded over (one process each)
    distributed_init_method: str | None = None  # default: a free loopback TCP port
    distributed_timeout: float = 600.0  # seconds a collective (or the join) may take
    log_level: str = "INFO"
    cpu_threads: int | None = None  # torch intra-op threads on the CPU (default: all cores)
    cpu_decode_threads: int | None = None  # threads of small steps (default: as above)

    @classmethod
    def parser(cls) -> argparse.ArgumentParser:
        p = argparse.ArgumentParser(
            prog="pagedserve executor",
            description="Run the executor: scheduler loop + model over a paged KV cache.",
        )
        a = p.add_argument
        a("--model", required=True, help="local Hugging Face checkpoint directory")
        a("--served-model-name", default=None)
        a("--dtype", default=cls.dtype, choices=["auto", "float32", "float16", "bfloat16"])
        a("--device", default=cls.device, choices=["auto", "cpu", "cuda"])
        a("--block-size", type=int, default=cls.block_size)
        a("--max-num-seqs", type=int, default=cls.max_num_seqs)
        a("--max-num-batched-tokens", type=int, default=cls.max_num_batched_tokens)
        a("--max-model-len", type=int, default=None)
        a("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True)
        a("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
        a("--gpu-memory-utilization", type=float, default=cls.gpu_memory_utilization)
        a(
            "--kv-cache-memory",
            type=_parse_bytes,
            default=None,
            help="KV-cache bytes (e.g. 512MiB); the CPU default is 256MiB",
        )
        a("--num-kv-blocks", type=int, default=None, help="exact number of KV blocks")
        add_tier_args(p, cls.kv_offloading_eviction_policy)
        a(
            "--preemption-mode",
            default="recompute",
            choices=["recompute", "swap"],
            help="how a sequence is preempted when the KV cache runs out: recompute (its "
            "blocks are freed, its tokens computed again) or swap (its blocks are copied to "
            "the host tier and back; needs --kv-offloading-size)",
        )
        a(
            "--disable-hybrid-kv-cache-manager",
            action="store_true",
            help="a model with sliding-window and full-attention layers keeps every block of "
            "every layer (one KV-cache group) instead of one group per kind",
        )
        a(
            "--eviction-policy",
            type=EvictionPolicyName,
            default=cls.eviction_policy,
            choices=list(EvictionPolicyName),
        )
        a(
            "--blockmgr",
            type=BlockManagerMode,
            default=cls.blockmgr,
            choices=list(BlockManagerMode),
            help="inproc: the block manager runs inside the executor; grpc: a block manager "
            "service at --blockmgr-address",
        )
        a(
            "--blockmgr-address",
            default=os.environ.get("PAGEDSERVE_BLOCKMGR_ADDRESS"),
            help="host:port of a block manager service (implies --blockmgr grpc)",
        )
        a("--pool-id", default=None)
        a("--watermark", type=float, default=cls.watermark)
        a(
            "--quantization",
            "-q",
            choices=QUANTIZATION_METHODS,
            default=None,
            help="the decoder's projections on the CPU (an fp32 model; the LM head and "
            "embeddings stay fp32): int8 (weights per row, activations per token, oneDNN), "
            "bf16 or fp16 (weights stored in 16 bits, multiplied in fp32: half the bytes, "
            "for CPUs without 16-bit arithmetic)",
        )
        a(
            "--kv-cache-dtype",
            choices=("auto", *KV_CACHE_DTYPE_NAMES),
            default=cls.kv_cache_dtype,
            help="the KV cache's dtype: auto (the model's), bfloat16 (for an fp32 model), "
            "fp8 (e4m3; e5m2), K/V scaled by per-layer k_scale / v_scale (the checkpoint's, "
            "or --calculate-kv-scales, else 1.0), or int8 (int8_per_token_head: a scale per "
            "token and head, kept in the block): 2-4x the blocks in the same memory",
        )
        a(
            "--calculate-kv-scales",
            action="store_true",
            help="an fp8 KV cache's per-layer k_scale / v_scale computed at start-up from a "
            "calibration prefill (max |K| / 200, max |V| / 100, vLLM's constants), instead of "
            "the checkpoint's or 1.0; fixed for the process's life",
        )
        a(
            "--session-pin-budget",
            type=float,
            default=cls.session_pin_budget,
            help="share of the KV blocks that session pins (a request's kv_pin_ttl_s) may keep "
            "once free, evicted after every unpinned block until their time (0: pins off)",
        )
        a("--seed", type=int, default=cls.seed)
        a(
            "--enforce-eager",
            action="store_true",
            help="never use CUDA graphs (decode steps then launch every kernel)",
        )
        a(
            "--async-scheduling",
            action=argparse.BooleanOptionalAction,
            default=cls.async_scheduling,
            help="plan the next step before this step's forward and send its block-manager "
            "Step without waiting, so the round trip overlaps the forward (outputs are "
            "unchanged; speculating, it plans for the most drafts; samples about to fork, "
            "beam search, copy-on-write and preemption still plan after sampling)",
        )
        a(
            "--speculative-config",
            default=None,
            help='speculative decoding as vLLM\'s JSON, e.g. \'{"method": "ngram", '
            '"num_speculative_tokens": 3, "prompt_lookup_max": 3}\' or \'{"model": DRAFT_DIR, '
            '"num_speculative_tokens": 3}\' or \'{"method": "eagle3", "model": HEAD_DIR, '
            '"num_speculative_tokens": 3}\': n-gram, draft-model or EAGLE-3 drafts verified in '
            "one forward (beam searches run unspeculated; a draft model or head needs "
            "full-attention layers: docs/speculative-decoding.md)",
        )
        a(
            "--runner",
            choices=("generate", "pooling"),
            default=cls.runner,
            help="generate: requests sample tokens; pooling: each request's prompt becomes one "
            "vector (embeddings: /v1/embeddings, Embed), the model's final hidden states",
        )
        a(
            "--pooler-config",
            default=None,
            help='with --runner pooling, vLLM\'s JSON: \'{"pooling_type": "LAST", "normalize": '
            "true}' (the defaults; MEAN and CLS compute every prompt token: no prefix caching)",
        )
        a(
            "--cuda-graph-sizes",
            type=_parse_sizes,
            default=None,
            help="decode batch sizes captured as CUDA graphs, e.g. 1,2,4,8,16 (default: 1, 2, "
            "4, then multiples of 8 up to --max-num-seqs)",
        )
        a(
            "--cpu-threads",
            type=int,
            default=None,
            help="torch intra-op threads on the CPU, shared by the tensor-parallel ranks "
            "(default: OMP_NUM_THREADS if set, else every core this process may use)",
        )
        a(
            "--cpu-decode-threads",
            type=int,
            default=None,
            help="fewer torch threads on the CPU for small steps (under 256 tokens of a 10 M "
            "parameter model, fewer of a larger one; a 160 M model's are all large), whose short "
            "ops stall when a thread is preempted: the cores left serve the gateway and clients "
            "(default: --cpu-threads for every step)",
        )
        a(
            "--tensor-parallel-size",
            "-tp",
            type=int,
            default=cls.tensor_parallel_size,
            help="shard the model over this many ranks (Megatron-style; one process and, on "
            "CUDA, one GPU each; NCCL on CUDA, gloo on the CPU)",
        )
        a(
            "--distributed-init-method",
            default=None,
            help="torch.distributed rendezvous of the ranks, e.g. tcp://127.0.0.1:29500 "
            "(default: a free loopback port)",
        )
        a(
            "--distributed-timeout",
            type=float,
            default=cls.distributed_timeout,
            help="seconds the ranks may take to join, or a collective to complete, before the "
            "executor gives up (a dead rank is noticed at once; this bounds a hung one)",
        )
        a(
            "--max-seqs-per-session",
            type=int,
            default=cls.max_seqs_per_session,
            help="sequences (samples) one gateway session may hold, waiting or running; more "
            "are refused RESOURCE_EXHAUSTED, so one gateway cannot starve the others",
        )
        a("--host", default=cls.host)
        a("--port", type=int, default=cls.port)
        a("--log-level", default=cls.log_level)
        InternalSecurity.add_args(p)
        LoRAConfig.add_args(p)
        return p

    @classmethod
    def from_args(cls, argv: list[str]) -> ExecutorConfig:
        p = cls.parser()
        ns = p.parse_args(argv)
        values = {k.replace("-", "_"): v for k, v in vars(ns).items()}
        values["security"] = InternalSecurity.from_namespace(values)
        values["lora"] = LoRAConfig.from_namespace(values)
        if values["blockmgr_address"]:
            values["blockmgr"] = BlockManagerMode.GRPC
        try:
            config = cls(**values)
        except ValueError as exc:
            p.error(str(exc))
        return config

    def __post_init__(self) -> None:
        # Strings are accepted where the enums are expected (Python callers, tests).
        object.__setattr__(self, "eviction_policy", _enum(EvictionPolicyName, self.eviction_policy))
        object.__setattr__(
            self,
            "kv_offloading_eviction_policy",
            _enum(EvictionPolicyName, self.kv_offloading_eviction_policy),
        )
        object.__setattr__(self, "blockmgr", _enum(BlockManagerMode, self.blockmgr))
        self.validate()

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first offending flag."""
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"--block-size must be a power of two, got {self.block_size}")
        if self.max_num_seqs < 1:
            raise ValueError("--max-num-seqs must be >= 1")
        if self.speculative_config is not None:
            try:
                SpeculativeConfig.parse(self.speculative_config)
            except ValueError as exc:
                raise ValueError(f"--speculative-config: {exc}") from None
        if self.runner not in ("generate", "pooling"):
            raise ValueError(f"--runner must be generate or pooling, got {self.runner!r}")
        try:
            pooler = PoolerConfig.parse(self.pooler_config)
        except ValueError as exc:
            raise ValueError(f"--pooler-config: {exc}") from None
        if self.tensor_parallel_size > 1 and pooler.classifier_from_token:
            raise ValueError("--pooler-config classifier_from_token needs --tensor-parallel-size 1")
        if self.pooler_config and self.runner != "pooling":
            raise ValueError("--pooler-config needs --runner pooling")
        if self.runner == "pooling" and self.speculative_config is not None:
            raise ValueError(
                "--speculative-config needs --runner generate (pooling drafts nothing)"
            )
        if not (math.isfinite(self.kv_offloading_size) and self.kv_offloading_size >= 0):
            raise ValueError(
                f"--kv-offloading-size must be >= 0 GiB, got {self.kv_offloading_size}"
            )
        if not (math.isfinite(self.kv_offloading_disk_size) and self.kv_offloading_disk_size >= 0):
            raise ValueError(
                f"--kv-offloading-disk-size must be >= 0 GiB, got {self.kv_offloading_disk_size}"
            )
        if self.kv_offloading_disk_size and not self.kv_offloading_size:
            raise ValueError(
                "--kv-offloading-disk-size needs --kv-offloading-size > 0: the disk tier sits "
                "below the host tier"
            )
        if self.kv_offloading_disk_size and not self.kv_offloading_disk_path:
            raise ValueError("--kv-offloading-disk-size needs --kv-offloading-disk-path")
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError(
                f"--preemption-mode must be recompute or swap, got {self.preemption_mode!r}"
            )
        if self.preemption_mode == "swap" and not self.kv_offloading_size:
            raise ValueError(
                "--preemption-mode swap needs --kv-offloading-size > 0: swapped-out blocks "
                "go to the host tier"
            )
        if self.calculate_kv_scales and not self.kv_cache_dtype.startswith("fp8"):
            raise ValueError(
                "--calculate-kv-scales computes an fp8 cache's scales: give --kv-cache-dtype "
                f"fp8 (or fp8_e4m3, fp8_e5m2), not {self.kv_cache_dtype}"
            )
        if self.max_num_batched_tokens < 1:
            raise ValueError("--max-num-batched-tokens must be >= 1")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError("--max-model-len must be >= 1")
        if self.num_kv_blocks is not None and self.kv_cache_memory is not None:
            raise ValueError("--num-kv-blocks and --kv-cache-memory are exclusive: give one")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError("--gpu-memory-utilization must be in (0, 1]")
        if self.blockmgr is BlockManagerMode.GRPC and not self.blockmgr_address:
            raise ValueError("--blockmgr grpc needs --blockmgr-address")
        if self.cuda_graph_sizes is not None and (
            not self.cuda_graph_sizes or min(self.cuda_graph_sizes) < 1
        ):
            raise ValueError("--cuda-graph-sizes must be positive integers")
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise ValueError("--cpu-threads must be >= 1")
        if self.cpu_decode_threads is not None and self.cpu_decode_threads < 1:
            raise ValueError("--cpu-decode-threads must be >= 1")
        if self.tensor_parallel_size < 1:
            raise ValueError("--tensor-parallel-size must be >= 1")
        if self.distributed_timeout <= 0:
            raise ValueError("--distributed-timeout must be positive")
        if not 0 <= self.watermark < 1:
            raise ValueError("--watermark must be in [0, 1)")
        if not 0 <= self.session_pin_budget < 1:
            raise ValueError("--session-pin-budget must be in [0, 1)")
        if not 0 <= self.port <= 65535:
            raise ValueError("--port must be in [0, 65535]")
        if self.max_seqs_per_session < 1:
            raise ValueError("--max-seqs-per-session must be >= 1")
        self.security.validate()
        self.lora.validate()

    @property
    def capture_sizes(self) -> tuple[int, ...]:
        """The decode batch sizes captured as CUDA graphs: ``--cuda-graph-sizes``, else
        vLLM's scheme: 1, 2, 4, then every multiple of 8 up to the first size that covers
        ``--max-num-seqs``."""
        if self.cuda_graph_sizes:
            return self.cuda_graph_sizes
        sizes = [1, 2, 4, *range(8, self.max_num_seqs + 8, 8)]
        cover = next(s for s in sizes if s >= self.max_num_seqs)
        return tuple(s for s in sizes if s <= cover)

    def runner_config(self) -> RunnerConfig:
        """The model side's part of this configuration."""
        spec = (
            SpeculativeConfig.parse(self.speculative_config)
            if self.speculative_config is not None
            else None
        )
        return RunnerConfig(
            model=self.model,
            cache=CacheConfig(
                block_size=self.block_size,
                gpu_memory_utilization=self.gpu_memory_utilization,
                kv_cache_memory=self.kv_cache_memory,
                num_kv_blocks=self.num_kv_blocks,
                hybrid_kv_cache=not self.disable_hybrid_kv_cache_manager,
                host_tier_bytes=int(self.kv_offloading_size * 2**30),
                disk_tier_bytes=int(self.kv_offloading_disk_size * 2**30),
                disk_tier_path=self.kv_offloading_disk_path,
            ),
            dtype=self.dtype,
            device=self.device,
            max_model_len=self.max_model_len,
            max_num_batched_tokens=self.max_num_batched_tokens,
            enforce_eager=self.enforce_eager,
            capture_sizes=self.capture_sizes,
            tensor_parallel_size=self.tensor_parallel_size,
            distributed_init_method=self.distributed_init_method,
            distributed_timeout=self.distributed_timeout,
            log_level=self.log_level,
            cpu_threads=self.cpu_threads,
            cpu_decode_threads=self.cpu_decode_threads,
            draft_model=spec.model if spec is not None and spec.uses_draft_model else None,
            eagle3_head=spec.model if spec is not None and spec.uses_eagle else None,
            num_speculative_tokens=spec.num_speculative_tokens if spec is not None else 0,
            max_loras=self.lora.max_loras if self.lora.enable_lora else 0,
            max_lora_rank=self.lora.max_lora_rank if self.lora.enable_lora else 0,
            quantization=self.quantization,
            kv_cache_dtype=self.kv_cache_dtype,
            calculate_kv_scales=self.calculate_kv_scales,
            pooling=self.runner == "pooling",
        )
