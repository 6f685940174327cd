"""The draft model of speculative decoding (``--speculative-config``'s ``draft_model``): a
smaller checkpoint of the same vocabulary, on the first rank, with its own KV cache of the
same blocks as the target's. A block id means the same token positions in both caches, so the
block manager's tables, prefix hits and copy-on-write serve the draft unchanged; each block
costs the target's bytes plus the draft's, which is how the cache is sized.

The draft's KV only ever shapes proposals: verification reads the target's. Where the draft's
copy of a block is stale (a block filled from the host or disk tier, or swapped back in, moves
the target's KV only), fewer drafts are accepted; no output changes.
"""

from __future__ import annotations

import structlog

from services.executor.model.errors import ModelLoadError
from services.executor.model.kv_cache import allocate_kv_cache, bytes_per_block
from services.executor.model.kv_layout import plan_kv_layout
from services.executor.model.loader import load_model
from services.executor.model.models import DecoderLM
from services.executor.model.parallel import ShardPlan, SingleComm
from services.executor.model.runner import ModelRunner

__all__ = ["draft_bytes_per_block", "draft_runner", "load_draft"]

log = structlog.get_logger(__name__)


def load_draft(path: str, target: DecoderLM) -> DecoderLM:
    """The draft checkpoint at ``path``, in the target's dtype on its device, serving the
    target's ``max_model_len``; one KV-cache group (its sliding layers, if any, read the
    target's full tables). A ``ModelLoadError`` naming ``speculative_config.model`` if it
    cannot be the target's draft."""
    tc = target.config
    try:
        draft = load_model(
            path,
            dtype=target.dtype,
            device=next(target.parameters()).device,
            max_model_len=tc.max_model_len,
            shard=lambda mc: ShardPlan.of(mc, 0, 1),
            comm=SingleComm(),
        )
    except (ModelLoadError, ValueError, OSError) as exc:
        raise ModelLoadError(f"speculative_config.model: {exc}") from None
    dc = draft.config
    draft.use_kv_layout(plan_kv_layout(draft.local_config, hybrid=False))
    log.info(
        "draft_model_loaded",
        model_dir=path,
        num_layers=dc.num_layers,
        vocab_size=dc.vocab_size,  # may differ by padding: drafts are the target's ids
        num_params=sum(p.numel() for p in draft.parameters()),
    )
    return draft


def draft_bytes_per_block(draft: DecoderLM, block_size: int) -> int:
    """What one block of the draft's cache costs, beside the target's."""
    return bytes_per_block(draft.local_config, block_size, draft.dtype, draft.kv_layout.num_slots)


def draft_runner(draft: DecoderLM, num_blocks: int, block_size: int) -> ModelRunner:
    """A runner of ``draft`` over a cache of the target's ``num_blocks`` blocks (its graphs
    are captured with the target's, by ``build_runner``)."""
    cache = allocate_kv_cache(
        draft.local_config,
        num_blocks,
        block_size,
        draft.dtype,
        next(draft.parameters()).device,
        draft.kv_layout.num_slots,
    )
    return ModelRunner(draft, cache, block_size)
