"""Building an engine from an :class:`ExecutorConfig`: the runner (model and sized KV cache),
the block-manager link, and what the executor's Info reports."""

from __future__ import annotations

import hashlib
import hmac
import json
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import structlog
import torch
from torch import Tensor
from transformers import AutoTokenizer

from services.blockmgr.api.errors import BlockManagerError
from services.blockmgr.api.protocol import BlockManagerClient
from services.blockmgr.api.types import AttentionKindName, KVCacheGroup, PoolSpec
from services.blockmgr.client import GrpcClient, InProcessClient
from services.common.blocks import usable_blocks
from services.common.limits import MAX_KV_RETENTION_PRIORITY
from services.executor.core.blockmgr_link import BlockManagerLink
from services.executor.core.config import EngineSettings
from services.executor.core.engine import Engine
from services.executor.core.engine_pooling import PoolingEngine
from services.executor.core.grammar import GrammarCompiler
from services.executor.core.lora import LoRARegistry
from services.executor.core.outputs import EngineError
from services.executor.core.pooling import Classifier, PoolerConfig
from services.executor.core.scheduler import SchedulerConfig
from services.executor.core.spec.config import SpeculativeConfig
from services.executor.model.config import ModelConfig
from services.executor.model.errors import ModelLoadError
from services.executor.model.kv_layout import KVCacheLayout
from services.executor.model.launch import build_runner
from services.executor.model.loader import load_tokenizer
from services.executor.model.models import DecoderLM
from services.executor.model.runner import ModelRunner
from services.executor.service.config import BlockManagerMode, ExecutorConfig

log = structlog.get_logger(__name__)


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
    runner: str = "generate"
    pooler: PoolerConfig | None = None  # how a pooling runner pools
    hidden_size: int = 0
    labels: tuple[str, ...] = ()  # a classifier's (a reranker's one score: "score")


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
    if mc.labels and config.runner != "pooling":
        raise ModelLoadError(
            f"{config.model}: a {mc.architecture} scores its labels and samples nothing: "
            "serve it with --runner pooling"
        )
    bs = runner.block_size
    usable = usable_blocks(runner.num_blocks)
    pool_id = default_pool_id(config)
    layout = runner.model.kv_layout
    groups = kv_cache_groups(layout)
    pool = PoolSpec(
        num_blocks=runner.num_blocks,
        block_size=bs,
        enable_prefix_caching=config.enable_prefix_caching,
        eviction_policy=config.eviction_policy,
        groups=groups,
        host_blocks=runner.host.num_slots if runner.host is not None else 0,
        disk_blocks=runner.host.disk.num_slots if runner.host and runner.host.disk else 0,
        tier_eviction_policy=config.kv_offloading_eviction_policy,
        # An EAGLE head's KV at a block's last position depends on the token after it: a
        # prefix hit's last block is computed again (core.spec.eagle).
        prefix_hit_margin=1 if getattr(runner, "eagle", None) is not None else 0,
        pin_budget_blocks=int(config.session_pin_budget * usable),
        kv_cache_dtype=str(runner.kv_cache.dtype).removeprefix("torch."),
        kv_scales=kv_scales_digest(runner.model),
    )
    client = blockmgr or connect_blockmgr(config)
    try:
        offered = client.info()
        max_groups, max_retention = offered.max_kv_cache_groups, offered.max_retention_priority
    except BlockManagerError:  # not reachable yet: the link waits, the registration checks
        max_groups, max_retention = len(groups), MAX_KV_RETENTION_PRIORITY
    if len(groups) > 1 and max_groups < len(groups):
        raise ModelLoadError(
            f"this model's KV cache is {len(groups)} KV-cache groups (sliding-window and "
            f"full-attention layers) and the block manager serves {max_groups} per pool: run "
            "one that serves hybrid pools, or pass --disable-hybrid-kv-cache-manager"
        )
    # Everything slow is built before the pool is registered: nothing renews its lease until
    # the engine loop runs, so a short lease could expire first (the executor would then find
    # its pool gone, NOT_FOUND, on its first Step).
    eos = eos_token_ids(config.model, mc)
    grammars = grammar_compiler(config.model, mc.vocab_size, eos)
    adapters = lora_registry(config, runner)
    link = BlockManagerLink(
        client,
        pool_id,
        pool,
        owner_token=pool_owner_token(config, pool_id),
        on_health=on_health,
    )
    # A Step allocates at most a budget of prompt blocks and a block per running sequence in
    # every group: evicted beyond the host tier's other slots, with no disk tier to store the
    # excess in, it is dropped.
    per_step = (-(-config.max_num_batched_tokens // bs) + config.max_num_seqs) * len(groups)
    if 0 < link.pool.host_blocks < per_step and not link.pool.disk_blocks:
        log.warning(
            "host_tier_smaller_than_a_step",
            host_blocks=link.pool.host_blocks,
            blocks_per_step=per_step,
            consequence="a Step that evicts more device blocks than the host tier has other "
            "slots keeps the excess in no tier (correct, but recomputed later)",
        )
    if pool.disk_blocks and link.pool.disk_blocks != pool.disk_blocks:
        log.warning(
            "disk_tier_not_served",
            asked=pool.disk_blocks,
            granted=link.pool.disk_blocks,
            consequence="blocks evicted from the host tier are dropped",
        )
    if pool.host_blocks and link.pool.host_blocks != pool.host_blocks:
        log.warning(
            "host_tier_not_served",
            asked=pool.host_blocks,
            granted=link.pool.host_blocks,
            consequence="blocks evicted from the KV cache are dropped",
        )
    try:
        window = _granted_window(groups, link.pool.groups, bs, usable, mc.max_model_len, layout)
    except ModelLoadError:
        link.unregister()  # not left held until its lease runs out
        raise
    pooler = PoolerConfig.parse(config.pooler_config)
    settings = EngineSettings(
        max_model_len=mc.max_model_len,
        vocab_size=mc.vocab_size,
        eos_token_ids=eos,
        scheduler=SchedulerConfig(
            block_size=bs,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            enable_chunked_prefill=config.enable_chunked_prefill,
            # (MEAN / CLS pooling computes every prompt token: no prefix hit is of use)
            enable_prefix_caching=config.enable_prefix_caching and not pooler.every_row,
            watermark_blocks=max(1, int(config.watermark * usable)) if config.watermark else 0,
            sliding_window=window,
            kv_group_slides=layout.group_slides if len(groups) > 1 else (),
            max_retention_priority=max_retention,
            swap_slots=link.pool.host_blocks if config.preemption_mode == "swap" else 0,
            max_loras=adapters.max_loras if adapters is not None else 0,
        ),
        seed=config.seed,
        async_scheduling=config.async_scheduling,
        speculative_config=_speculative(config, groups),
    )
    if config.runner == "pooling":
        engine: Engine = PoolingEngine(
            settings,
            runner,
            link,
            pooler,
            mc.hidden_size,
            grammars,
            adapters,
            classifier(config.model, runner.model, pooler),
        )
    else:
        engine = Engine(settings, runner, link, grammars, adapters)
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
        runner=config.runner,
        pooler=pooler if config.runner == "pooling" else None,
        hidden_size=mc.hidden_size,
        labels=mc.labels or (("score",) if pooler.classifier_from_token else ()),
    )
    return engine, served


def classifier(model_dir: str, model: DecoderLM, pooler: PoolerConfig) -> Classifier | None:
    """What a pooling runner scores with: a sequence classifier's score head, a reranker's
    ``classifier_from_token`` rows of the LM head, or None (it returns vectors)."""
    if model.config.labels:
        if pooler.classifier_from_token:
            raise ModelLoadError(
                "--pooler-config: classifier_from_token reads an LM head; this checkpoint "
                f"({model.config.architecture}) is a classifier with a score head of its own"
            )
        return Classifier(model.score.detach())
    rows = classifier_rows(model_dir, model, pooler.classifier_from_token)
    return None if rows is None else Classifier(rows, True, model.config.final_logit_softcap)


def classifier_rows(model_dir: str, model: DecoderLM, tokens: tuple[str, ...]) -> Tensor | None:
    """The LM head's rows of a reranker's ``classifier_from_token`` pair (each must be one
    token of the checkpoint's tokenizer; :class:`ModelLoadError` names the one that is not),
    or None without one."""
    if not tokens:
        return None
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    ids = []
    for token in tokens:
        found = tokenizer.encode(token, add_special_tokens=False)
        if len(found) != 1:
            raise ModelLoadError(
                f"--pooler-config: classifier_from_token {token!r} is {len(found)} tokens of "
                "this tokenizer, not one"
            )
        ids.append(found[0])
    return model.lm_head.weight[torch.tensor(ids, device=model.lm_head.weight.device)].detach()


def kv_scales_digest(model: DecoderLM) -> str:
    """A digest of the per-layer scales an fp8 cache stores K/V under ('' for none: an int8
    cache's scales are in its records)."""
    if model.kv_cache_dtype == model.dtype or not model.kv_cache_dtype.is_floating_point:
        return ""
    scales = [
        (getattr(layer.self_attn, "k_scale", 1.0), getattr(layer.self_attn, "v_scale", 1.0))
        for layer in model.layers
    ]
    return hashlib.sha256(json.dumps(scales).encode()).hexdigest()[:16]


def lora_registry(config: ExecutorConfig, runner: ModelRunner) -> LoRARegistry | None:
    """With ``--enable-lora``: the runner's slot table (attached here unless
    ``build_runner`` did, as it does on every rank of a tensor-parallel model) and the
    registry of adapters, the ``--lora-modules`` loaded (:class:`ModelLoadError` naming the
    one that cannot serve)."""
    lora = config.lora
    if not lora.enable_lora:
        return None
    slots = runner.lora or runner.attach_lora(lora.max_loras, lora.max_lora_rank)
    registry = LoRARegistry(slots, lora.cpu_loras)
    for module in lora.lora_modules:
        try:
            version = registry.load(module.name, module.path)
        except EngineError as exc:
            where = f"--lora-modules {module.name}={module.path}"
            raise ModelLoadError(f"{where}: {exc.message}") from None
        log.info("lora_adapter_loaded", name=version.name, path=version.path, rank=version.rank)
    return registry


def _speculative(
    config: ExecutorConfig, groups: tuple[KVCacheGroup, ...]
) -> SpeculativeConfig | None:
    if config.speculative_config is None:
        return None
    spec = SpeculativeConfig.parse(config.speculative_config)  # (checked by validate)
    if spec.has_draft_cache and groups and all(g.sliding_window for g in groups):
        raise ModelLoadError(
            f"--speculative-config: every layer of this model slides, and {spec.method} reads "
            "the blocks of a full-attention KV-cache group: use the ngram method"
        )
    return spec


def grammar_compiler(
    model_dir: str, vocab_size: int, eos_token_ids: Sequence[int]
) -> GrammarCompiler | None:
    """The structured-output grammar compiler over the checkpoint's tokenizer; None (such
    requests refused, the rest served) when the checkpoint has no tokenizer."""
    try:
        tokenizer = load_tokenizer(model_dir)
    except ModelLoadError as exc:
        log.warning("structured_outputs_unavailable", reason=str(exc))
        return None
    try:
        return GrammarCompiler(tokenizer, vocab_size, eos_token_ids)
    except Exception as exc:  # a tokenizer xgrammar cannot read: serve the rest
        log.warning("structured_outputs_unavailable", reason=repr(exc))
        return None


def kv_cache_groups(layout: KVCacheLayout) -> tuple[KVCacheGroup, ...]:
    """The pool's KV-cache groups, as the model lays its cache out: none (one full group,
    every block kept) when every layer attends to everything or the hybrid manager is off;
    one sliding group when every layer slides with one window (Mistral, windowed Qwen2 /
    Mixtral / Phi-3), so that blocks out of the window go back to the pool; a group per
    :class:`KVCacheLayout` group in a hybrid model (Gemma 2/3)."""
    if layout.num_groups == 1 and not layout.sliding_window:
        return ()
    return tuple(
        KVCacheGroup(AttentionKindName.SLIDING, w, layers)
        if w
        else KVCacheGroup(AttentionKindName.FULL, 0, layers)
        for w, layers in zip(layout.windows, layout.group_layers, strict=True)
    )


def _granted_window(
    asked: tuple[KVCacheGroup, ...],
    granted: tuple[KVCacheGroup, ...],
    block_size: int,
    usable: int,
    max_model_len: int,
    layout: KVCacheLayout,
) -> int:
    """The sliding window the scheduler releases blocks by: the one asked for when the block
    manager registered the pool with it; 0 (every block kept) when a one-group pool was not
    (an implementation that predates KV-cache groups ignores them). A hybrid pool not served
    as asked is a :class:`ModelLoadError`: the cache is laid out by groups."""
    if not asked:
        return 0
    if tuple(granted) != asked:
        log.warning(
            "kv_cache_groups_not_served",
            asked=[g.kind.value for g in asked],
            granted=[g.kind.value for g in granted],
            consequence="every block is kept, as with full attention",
        )
        if len(asked) > 1:
            raise ModelLoadError(
                f"the block manager registered the pool with {len(granted)} KV-cache "
                f"group(s), not the {len(asked)} asked for: run one that serves hybrid "
                "pools, or pass --disable-hybrid-kv-cache-manager"
            )
        if usable * block_size < max_model_len:  # sized for a sliding pool: too small now
            raise ModelLoadError(
                f"the block manager does not serve sliding-window pools and the KV cache "
                f"holds {usable * block_size} tokens, fewer than max_model_len="
                f"{max_model_len}: give more KV-cache memory or a smaller --max-model-len"
            )
        return 0
    window = layout.sliding_window
    per_seq = layout.blocks_per_sequence(max_model_len, block_size)
    full = layout.num_groups * -(-max_model_len // block_size)
    log.info(
        "kv_cache_groups",
        kinds=[g.kind.value for g in asked],
        sliding_window=window,
        blocks_per_decoding_sequence=per_seq,
        max_concurrency=round(usable / per_seq, 2),
        max_concurrency_full_attention=round(usable / full, 2),
    )
    return window
