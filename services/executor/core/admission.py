"""Admission planning: which waiting sequences join this step, within the token budget,
``max_num_seqs`` and the free blocks, leaving headroom for the running ones to grow."""

from __future__ import annotations

from services.blockmgr.types import Admit
from services.common.blocks import blocks_for_tokens
from services.executor.core.config import SchedulerConfig
from services.executor.core.plan import SchedulePlan
from services.executor.core.sequence import Sequence

__all__ = ["plan_admissions", "uncommitted_prompt_blocks"]


def plan_admissions(
    plan: SchedulePlan,
    waiting: list[Sequence],
    running: list[Sequence],
    config: SchedulerConfig,
    free: int,
    budget: int,
) -> None:
    """Add to ``plan`` the admissions of ``waiting`` sequences, in priority order (FCFS within a
    priority), that fit ``free`` blocks and ``budget`` tokens beside the ``running`` ones.

    An admission must leave ``watermark_blocks`` plus one block per sequence that will be
    running free: each running sequence needs at most one new block in the next
    ``block_size`` steps, so this headroom keeps growth from preempting what was just
    admitted (admitting on prompt blocks alone makes the newest sequences thrash:
    admitted, preempted, recomputed, again). With nothing running no headroom is needed.
    """
    if not waiting:
        return
    cfg = config
    bs = cfg.block_size
    num_running = len(running)
    speculative = False
    admits = plan.admits
    hold_back = cfg.enable_prefix_caching and cfg.hold_back_shared_prefixes
    computing = uncommitted_prompt_blocks(running, cfg.block_size) if hold_back else set()
    for seq in waiting:
        if budget <= 0 or num_running + len(admits) >= cfg.max_num_seqs:
            break
        total = seq.num_tokens
        # Prompt log-probabilities need every prompt token computed: no prefix-cache hit.
        lookup = cfg.enable_prefix_caching and seq.params.prompt_logprobs is None
        hashes = tuple(seq.full_block_hashes(bs)[: total // bs]) if lookup else ()
        if hold_back and hashes and not computing.isdisjoint(hashes):
            continue  # its prefix is being computed: it hits it, committed, next step
        if not cfg.enable_chunked_prefill and total > budget:
            break
        k_max = budget if cfg.enable_chunked_prefill else total
        first = min(total, k_max)
        upper = blocks_for_tokens(first, bs)  # blocks if nothing is cached
        others = num_running + len(admits)
        reserve = cfg.watermark_blocks + others if others else 0
        if upper + reserve > free:
            # A prefix hit may still make it fit: send it, but nothing after it (FCFS).
            if not cfg.enable_prefix_caching or speculative:
                break
            speculative = True
        admits.append((seq, Admit(seq.seq_id, total, k_max, hashes, reserve)))
        computing.update(hashes)
        free -= min(upper, free)
        budget -= first
        if speculative:
            break


def uncommitted_prompt_blocks(running: list[Sequence], block_size: int) -> set[bytes]:
    """Hashes of the full prompt blocks running sequences are computing but have not
    committed yet (a prefill in progress)."""
    bs = block_size
    blocks: set[bytes] = set()
    for seq in running:
        full = seq.prompt_len // bs
        if seq.num_committed_blocks < full:
            blocks.update(seq.full_block_hashes(bs)[seq.num_committed_blocks : full])
    return blocks
