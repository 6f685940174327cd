"""Building an engine from an :class:`ExecutorConfig`: load the model, size the KV cache,
connect the block manager, and log the capacity as vLLM does."""

from __future__ import annotations

import json
import math
import socket
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import structlog
import torch

from services.blockmgr.client import BlockManagerClient, GrpcClient, InProcessClient
from services.executor.config import ExecutorConfig
from services.executor.engine import Engine, EngineSettings
from services.executor.forward_batch import SeqChunk
from services.executor.kv_cache import allocate_kv_cache, bytes_per_block, num_blocks_for_budget
from services.executor.loader import load_model, resolve_device
from services.executor.model import DecoderLM
from services.executor.model_config import ModelConfig
from services.executor.model_runner import ModelRunner
from services.executor.scheduler import SchedulerConfig

log = structlog.get_logger(__name__)

CPU_DEFAULT_KV_BYTES = 256 * 2**20


@dataclass(frozen=True)
class ServedModel:
    """What the executor's Info reports."""

    name: str
    dtype: str
    max_model_len: int
    block_size: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    num_kv_blocks: int
    device: str


def eos_token_ids(model_dir: str | Path, config: ModelConfig) -> tuple[int, ...]:
    """EOS ids of ``config.json`` merged with ``generation_config.json``'s (Llama-3 style)."""
    ids = list(config.eos_token_ids)
    gen = Path(model_dir) / "generation_config.json"
    if gen.is_file():
        value = json.loads(gen.read_text()).get("eos_token_id")
        for t in value if isinstance(value, list) else [value]:
            if isinstance(t, int) and t not in ids:
                ids.append(t)
    return tuple(ids)


def profile_num_blocks(
    model: DecoderLM, config: ExecutorConfig, block_size: int
) -> int:
    """GPU: blocks that fit in ``gpu_memory_utilization`` of the device after the weights and
    the peak activations of a forward at ``max_num_batched_tokens`` (measured, not guessed)."""
    device = next(model.parameters()).device
    mc = model.config
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    num_tokens = min(config.max_num_batched_tokens, mc.max_model_len)
    probe_blocks = math.ceil(num_tokens / block_size) + 1
    probe = allocate_kv_cache(mc, probe_blocks, block_size, model.dtype, device)
    chunk = SeqChunk([0] * num_tokens, 0, list(range(1, probe_blocks)), True)
    runner = ModelRunner(model, probe, block_size)
    runner.execute([chunk])
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    del runner, probe
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(device).total_memory
    budget = int(total * config.gpu_memory_utilization) - peak
    log.info("kv_cache_profiled", total_bytes=total, peak_bytes=peak, budget_bytes=budget,
             gpu_memory_utilization=config.gpu_memory_utilization)  # fmt: skip
    if budget <= 0:
        raise RuntimeError(
            f"no memory left for the KV cache: peak use {peak} bytes exceeds "
            f"{config.gpu_memory_utilization} of {total}; raise --gpu-memory-utilization"
        )
    return num_blocks_for_budget(mc, block_size, model.dtype, budget)


def load_runner(config: ExecutorConfig) -> ModelRunner:
    device = resolve_device("cuda" if config.device == "auto" and torch.cuda.is_available()
                            else ("cpu" if config.device == "auto" else config.device))  # fmt: skip
    model = load_model(config.model, dtype=config.dtype, device=device,
                       max_model_len=config.max_model_len)  # fmt: skip
    bs = config.block_size
    if config.num_kv_blocks is not None:
        num_blocks = config.num_kv_blocks
    elif device.type == "cuda" and config.kv_cache_memory is None:
        num_blocks = profile_num_blocks(model, config, bs)
    else:
        budget = config.kv_cache_memory or CPU_DEFAULT_KV_BYTES
        num_blocks = num_blocks_for_budget(model.config, bs, model.dtype, budget)
    kv_cache = allocate_kv_cache(model.config, num_blocks, bs, model.dtype, device)
    runner = ModelRunner(model, kv_cache, bs)
    mc = model.config
    tokens = (num_blocks - 1) * bs
    log.info(
        "kv_cache_sized",
        num_blocks=num_blocks,
        num_usable_blocks=num_blocks - 1,
        num_tokens=tokens,
        bytes=num_blocks * bytes_per_block(mc, bs, model.dtype),
        max_model_len=mc.max_model_len,
        max_concurrency=round(tokens / mc.max_model_len, 2),
    )
    if tokens < mc.max_model_len:
        raise ValueError(
            f"the KV cache holds {tokens} tokens, fewer than max_model_len={mc.max_model_len}: "
            "a single full-length sequence could never run; give more KV-cache memory or a "
            "smaller --max-model-len"
        )
    return runner


def connect_blockmgr(config: ExecutorConfig) -> BlockManagerClient:
    if config.blockmgr == "grpc":
        assert config.blockmgr_address
        return GrpcClient(config.blockmgr_address, timeout_s=2.0)
    return InProcessClient()


def default_pool_id(config: ExecutorConfig) -> str:
    return config.pool_id or f"executor-{socket.gethostname()}-{config.port}"


def build_engine(
    config: ExecutorConfig,
    *,
    runner: ModelRunner | None = None,
    blockmgr: BlockManagerClient | None = None,
    on_health: Callable[[bool], None] | None = None,
) -> tuple[Engine, ServedModel]:
    runner = runner or load_runner(config)
    mc = runner.config
    bs = runner.block_size
    usable = runner.num_blocks - 1
    settings = EngineSettings(
        max_model_len=mc.max_model_len,
        vocab_size=mc.vocab_size,
        eos_token_ids=eos_token_ids(config.model, mc),
        scheduler=SchedulerConfig(
            block_size=bs,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=mc.max_model_len,
            enable_chunked_prefill=config.enable_chunked_prefill,
            enable_prefix_caching=config.enable_prefix_caching,
            watermark_blocks=max(1, int(config.watermark * usable)) if config.watermark else 0,
        ),
        pool_id=default_pool_id(config),
        eviction_policy=config.eviction_policy,
        seed=config.seed,
    )
    engine = Engine(settings, runner, blockmgr or connect_blockmgr(config), on_health=on_health)
    served = ServedModel(
        name=config.served_model_name or Path(config.model).name,
        dtype=str(runner.dtype).removeprefix("torch."),
        max_model_len=mc.max_model_len,
        block_size=bs,
        vocab_size=mc.vocab_size,
        eos_token_ids=settings.eos_token_ids,
        num_kv_blocks=runner.num_blocks,
        device=str(runner.device),
    )
    return engine, served
