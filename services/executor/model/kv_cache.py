"""Sizing and allocating the executor's paged KV cache: one tensor for all layers.

Layout: ``kv_cache[num_slots, 2, num_blocks, block_size, num_kv_heads, head_dim]``: a slice per
layer (``num_slots`` = the number of layers), or in a hybrid model a slice per layer of a
KV-cache group, shared by the groups (:mod:`.kv_layout`). Layer ``l`` reads and writes
``kv_cache[slot, 0]`` (K) and ``kv_cache[slot, 1]`` (V) of its slot. Block 0 is reserved by
the block manager and serves as padding in block tables, so a pool of ``num_blocks`` blocks
holds ``num_blocks - 1`` usable ones. An int8 cache's last dimension is a record of
``head_dim + 4`` bytes (the codes, then their fp32 scale: :mod:`pagedserve.kernels.kv_quant`).
"""

from __future__ import annotations

import math

import structlog
import torch

from pagedserve.kernels.kv_quant import cache_head_dim
from services.common.blocks import MIN_NUM_BLOCKS, usable_blocks
from services.executor.model.config import ModelConfig
from services.executor.model.errors import ModelLoadError
from services.executor.model.forward_batch import SeqChunk, build_forward_batch
from services.executor.model.models import DecoderLM
from services.executor.model.runner_config import CacheConfig

__all__ = [
    "allocate_kv_cache",
    "bytes_per_block",
    "kv_cache_shape",
    "num_blocks_for_budget",
    "size_kv_cache",
]

log = structlog.get_logger(__name__)

CPU_DEFAULT_KV_BYTES = 256 * 2**20


def kv_cache_shape(
    config: ModelConfig,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    num_slots: int | None = None,
) -> tuple[int, int, int, int, int, int]:
    """Shape of the cache tensor in ``dtype``: ``[num_slots, 2, num_blocks, block_size, Hkv,
    D]`` (``num_slots``: by default one per layer; ``D`` a record's bytes for int8)."""
    slots = config.num_layers if num_slots is None else num_slots
    width = cache_head_dim(config.head_dim, dtype)
    return (slots, 2, num_blocks, block_size, config.num_kv_heads, width)


def bytes_per_block(
    config: ModelConfig, block_size: int, dtype: torch.dtype, num_slots: int | None = None
) -> int:
    """Bytes one block occupies across the cache's slots (by default every layer), K and V."""
    return math.prod(kv_cache_shape(config, 1, block_size, dtype, num_slots)) * dtype.itemsize


def num_blocks_for_budget(
    config: ModelConfig,
    block_size: int,
    dtype: torch.dtype,
    budget_bytes: int,
    num_slots: int | None = None,
    extra_bytes_per_block: int = 0,
) -> int:
    """How many blocks (including the reserved block 0) fit in ``budget_bytes``, each also
    costing ``extra_bytes_per_block`` (a draft model's KV of the same block).

    Raises ``ValueError`` when the budget holds fewer than two blocks (nothing usable).
    """
    per_block = bytes_per_block(config, block_size, dtype, num_slots) + extra_bytes_per_block
    num_blocks = budget_bytes // per_block
    if num_blocks < MIN_NUM_BLOCKS:
        raise ValueError(
            f"KV-cache budget of {budget_bytes} bytes holds {num_blocks} blocks of "
            f"{per_block} bytes; need at least {MIN_NUM_BLOCKS}"
        )
    return int(num_blocks)


def allocate_kv_cache(
    config: ModelConfig,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device | str,
    num_slots: int | None = None,
) -> torch.Tensor:
    """Allocate the zero-filled cache tensor (zeros so padding reads are finite)."""
    if num_blocks < MIN_NUM_BLOCKS:
        raise ValueError(
            f"num_blocks={num_blocks}: need at least {MIN_NUM_BLOCKS} (block 0 is reserved)"
        )
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    shape = kv_cache_shape(config, num_blocks, block_size, dtype, num_slots)
    return torch.zeros(shape, dtype=dtype, device=device)


def size_kv_cache(
    model: DecoderLM,
    config: CacheConfig,
    *,
    max_num_batched_tokens: int,
    graph_sizes: tuple[int, ...] = (),
    graph_output_bytes: int = 0,
    extra_bytes_per_block: int = 0,
) -> int:
    """How many blocks (block 0 included) the executor's KV cache gets, the one place that
    decides it: ``--num-kv-blocks`` exactly, else ``--kv-cache-memory`` bytes, else on CUDA
    what ``--gpu-memory-utilization`` of the device leaves after a profiled forward, else the
    CPU default budget. Under tensor parallelism each rank sizes its own shard (its KV heads)
    and the count is the minimum over the ranks, so that one block id means the same slot
    everywhere. The profile runs a forward of ``max_num_batched_tokens`` tokens and sets
    aside what the CUDA graphs keep: the largest of ``graph_sizes``' forward (measured), and
    ``graph_output_bytes`` besides (the other graphs' logits, which each keeps). A budget pays
    ``extra_bytes_per_block`` per block besides (a draft model's cache of the same blocks).
    Raises ``ValueError`` when one full-length sequence would not fit."""
    mc, bs, device = model.local_config, config.block_size, next(model.parameters()).device
    layout = model.kv_layout
    slots = layout.num_slots
    if config.num_kv_blocks is not None:
        num_blocks = config.num_kv_blocks
    elif config.kv_cache_memory is not None or device.type != "cuda":
        budget = config.kv_cache_memory or CPU_DEFAULT_KV_BYTES
        num_blocks = num_blocks_for_budget(
            mc, bs, model.kv_cache_dtype, budget, slots, extra_bytes_per_block
        )
    else:
        budget = _profile_budget(model, config, max_num_batched_tokens, graph_sizes)
        if graph_output_bytes:
            budget -= graph_output_bytes
            log.info("cuda_graph_logits_reserved", bytes=graph_output_bytes)
        num_blocks = num_blocks_for_budget(
            mc, bs, model.kv_cache_dtype, budget, slots, extra_bytes_per_block
        )
    num_blocks = model.comm.min_int(num_blocks)
    usable = usable_blocks(num_blocks)
    log.info(
        "kv_cache_sized",
        num_blocks=num_blocks,
        num_usable_blocks=usable,
        num_kv_cache_groups=layout.num_groups,
        bytes=num_blocks
        * (bytes_per_block(mc, bs, model.kv_cache_dtype, slots) + extra_bytes_per_block),
        max_model_len=mc.max_model_len,
        # vLLM's "Maximum concurrency for N tokens per request", with the groups counted:
        # a sliding group holds only its window's blocks.
        max_concurrency=round(usable / layout.blocks_per_sequence(mc.max_model_len, bs), 2),
    )
    need = layout.blocks_per_sequence(mc.max_model_len, bs, chunk=max_num_batched_tokens)
    if usable < need:
        raise ValueError(
            f"the KV cache holds {usable} blocks of {bs} tokens, fewer than the {need} one "
            f"sequence may need (max_model_len={mc.max_model_len}, {layout.num_groups} KV-cache "
            "group(s)): a single full-length sequence could never run; give more KV-cache "
            "memory or a smaller --max-model-len"
        )
    return num_blocks


@torch.inference_mode()
def _profile_budget(
    model: DecoderLM, config: CacheConfig, max_num_batched_tokens: int, graph_sizes: tuple[int, ...]
) -> int:
    """CUDA: bytes left for the KV cache in ``gpu_memory_utilization`` of the device after the
    weights and the peak activations of a forward at ``max_num_batched_tokens`` (measured,
    not guessed)."""
    device = next(model.parameters()).device
    mc, bs = model.local_config, config.block_size
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    num_tokens = min(max_num_batched_tokens, mc.max_model_len)
    probe_blocks = math.ceil(num_tokens / bs) + 1
    probe = allocate_kv_cache(mc, probe_blocks, bs, model.kv_cache_dtype, device)
    chunk = SeqChunk([0] * num_tokens, 0, list(range(1, probe_blocks)), True)
    batch = build_forward_batch(
        [chunk],
        bs,
        device,
        num_blocks=probe_blocks,
        max_model_len=mc.max_model_len,
        vocab_size=mc.vocab_size,
    )
    model(batch, probe)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    graph_bytes = 0
    if graph_sizes:
        # The decode graphs keep their largest forward's intermediates for good: measure
        # that forward (every sequence at position 0 of block 1) and set its peak aside.
        size = max(graph_sizes)
        decode = [SeqChunk([0], 0, [1], True)] * size
        batch = build_forward_batch(
            decode,
            bs,
            device,
            num_blocks=probe_blocks,
            max_model_len=mc.max_model_len,
            vocab_size=mc.vocab_size,
        )
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        model(batch, probe)
        torch.cuda.synchronize(device)
        graph_bytes = torch.cuda.max_memory_allocated(device) - base
    del probe, batch
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(device).total_memory
    budget = int(total * config.gpu_memory_utilization) - peak - graph_bytes
    log.info(
        "kv_cache_profiled",
        total_bytes=total,
        peak_bytes=peak,
        cuda_graph_reserve_bytes=graph_bytes,
        budget_bytes=budget,
        gpu_memory_utilization=config.gpu_memory_utilization,
    )
    if budget <= 0:
        raise RuntimeError(
            f"no memory left for the KV cache: peak use {peak} bytes exceeds "
            f"{config.gpu_memory_utilization} of {total}; raise --gpu-memory-utilization"
        )
    return budget


#: ``--kv-cache-dtype`` values other than ``auto`` (the model's dtype), vLLM's names
#: (``runner_config.KV_CACHE_DTYPE_NAMES``, which the CLI offers without importing torch).
KV_CACHE_DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
    "int8": torch.int8,
    "int8_per_token_head": torch.int8,
}


def kv_cache_torch_dtype(name: str, config: ModelConfig) -> torch.dtype:
    """The cache dtype ``--kv-cache-dtype NAME`` stores K/V in; :class:`ModelLoadError`
    naming the flag for one this model cannot be served with."""
    if name not in KV_CACHE_DTYPES:
        raise ModelLoadError(
            f"--kv-cache-dtype {name!r}: choose auto or one of {sorted(KV_CACHE_DTYPES)}"
        )
    dtype = KV_CACHE_DTYPES[name]
    try:  # an int8 record keeps its fp32 scale 4-byte aligned
        cache_head_dim(config.head_dim, dtype)
    except ValueError as e:
        raise ModelLoadError(f"--kv-cache-dtype {name}: {e}") from None
    return dtype
