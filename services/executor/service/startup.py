"""Building an engine from an :class:`ExecutorConfig`: the runner (model and sized KV cache),
the block-manager link, and what the executor's Info reports."""

from __future__ import annotations

import hashlib
import hmac
import json
import socket
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from services.blockmgr.client import BlockManagerClient, GrpcClient, InProcessClient
from services.common.blocks import usable_blocks
from services.executor.core.blockmgr_link import BlockManagerLink, PoolSpec
from services.executor.core.config import EngineSettings
from services.executor.core.engine import Engine
from services.executor.core.scheduler import SchedulerConfig
from services.executor.model.config import ModelConfig
from services.executor.model.errors import ModelLoadError
from services.executor.model.launch import build_runner
from services.executor.model.runner import ModelRunner
from services.executor.service.config import BlockManagerMode, ExecutorConfig


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
    pool_id: str
    tensor_parallel_size: int = 1


def eos_token_ids(model_dir: str | Path, config: ModelConfig) -> tuple[int, ...]:
    """EOS ids of ``config.json`` merged with ``generation_config.json``'s (Llama-3 style)."""
    ids = list(config.eos_token_ids)
    gen = Path(model_dir) / "generation_config.json"
    if gen.is_file():
        try:
            value = json.loads(gen.read_text()).get("eos_token_id")
        except (ValueError, AttributeError) as exc:
            raise ModelLoadError(f"{gen}: not a JSON object ({exc})") from None
        for t in value if isinstance(value, list) else [value]:
            if isinstance(t, int) and t not in ids:
                ids.append(t)
    return tuple(ids)


def connect_blockmgr(config: ExecutorConfig) -> BlockManagerClient:
    if config.blockmgr is BlockManagerMode.GRPC:
        assert config.blockmgr_address
        return GrpcClient(
            config.blockmgr_address,
            timeout_s=2.0,
            internal_token=config.security.token,
            credentials=config.security.channel_credentials(),
        )
    return InProcessClient()


def default_pool_id(config: ExecutorConfig) -> str:
    return config.pool_id or f"executor-{socket.gethostname()}-{config.port}"


def pool_owner_token(config: ExecutorConfig, pool_id: str) -> str | None:
    """The executor's owner token for its pool: derived from the internal token, so that the
    executor restarted after a crash owns its pool at once (no wait for the lease); without an
    internal token the block manager picks a random one."""
    secret = config.security.token
    if not secret:
        return None
    return hmac.new(secret.encode(), f"pool-owner:{pool_id}".encode(), hashlib.sha256).hexdigest()


def build_engine(
    config: ExecutorConfig,
    *,
    runner: ModelRunner | None = None,
    blockmgr: BlockManagerClient | None = None,
    on_health: Callable[[bool], None] | None = None,
) -> tuple[Engine, ServedModel]:
    if runner is not None:
        return _build_engine(config, runner, blockmgr, on_health)
    runner = build_runner(config.runner_config())
    try:
        return _build_engine(config, runner, blockmgr, on_health)
    except BaseException:
        runner.close()  # the other tensor-parallel ranks, if any, must not outlive this
        raise


def _build_engine(
    config: ExecutorConfig,
    runner: ModelRunner,
    blockmgr: BlockManagerClient | None,
    on_health: Callable[[bool], None] | None,
) -> tuple[Engine, ServedModel]:
    mc = runner.config
    bs = runner.block_size
    usable = usable_blocks(runner.num_blocks)
    settings = EngineSettings(
        max_model_len=mc.max_model_len,
        vocab_size=mc.vocab_size,
        eos_token_ids=eos_token_ids(config.model, mc),
        scheduler=SchedulerConfig(
            block_size=bs,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            enable_chunked_prefill=config.enable_chunked_prefill,
            enable_prefix_caching=config.enable_prefix_caching,
            watermark_blocks=max(1, int(config.watermark * usable)) if config.watermark else 0,
        ),
        seed=config.seed,
        async_scheduling=config.async_scheduling,
    )
    pool_id = default_pool_id(config)
    pool = PoolSpec(
        pool_id=pool_id,
        owner_token=pool_owner_token(config, pool_id),
        num_blocks=runner.num_blocks,
        block_size=bs,
        enable_prefix_caching=config.enable_prefix_caching,
        eviction_policy=config.eviction_policy,
    )
    link = BlockManagerLink(blockmgr or connect_blockmgr(config), pool, on_health=on_health)
    engine = Engine(settings, runner, link)
    served = ServedModel(
        name=config.served_model_name or Path(config.model).name,
        dtype=str(runner.dtype).removeprefix("torch."),
        max_model_len=mc.max_model_len,
        block_size=bs,
        vocab_size=mc.vocab_size,
        eos_token_ids=settings.eos_token_ids,
        num_kv_blocks=runner.num_blocks,
        device=str(runner.device),
        pool_id=pool_id,
        tensor_parallel_size=runner.model.shard.size,
    )
    return engine, served
