"""Admission planning: which waiting sequences join this step, within the token budget,
``max_num_seqs`` and the free blocks, leaving headroom for the running ones to grow."""

from __future__ import annotations

from services.blockmgr.api.types import Admit
from services.common.blocks import blocks_for_tokens
from services.executor.core.config import SchedulerConfig
from services.executor.core.plan import SchedulePlan
from services.executor.core.sequence import Sequence

__all__ = ["plan_admissions", "running_adapters", "uncommitted_prompt_blocks"]


def plan_admissions(
    plan: SchedulePlan,
    waiting: list[Sequence],
    running: list[Sequence],
    config: SchedulerConfig,
    free: int,
    budget: int,
    num_leaving: int = 0,
) -> None:
    """Add to ``plan`` the admissions of ``waiting`` sequences, in priority order (FCFS within a
    priority), that fit ``free`` blocks and ``budget`` tokens beside the ``running`` ones
    (``num_leaving`` of which end before the step planned: their seats are free).

    An admission must leave ``watermark_blocks`` plus one block per sequence that will be
    running free: each running sequence needs at most one new block in the next
    ``block_size`` steps, so this headroom keeps growth from preempting what was just
    admitted (admitting on prompt blocks alone makes the newest sequences thrash:
    admitted, preempted, recomputed, again). With nothing running no headroom is needed.
    In a hybrid pool a sequence's blocks are counted in every KV-cache group, and the headroom
    in the groups that keep their blocks (a sliding group releases about as fast as it grows).
    With multi-LoRA serving, a sequence whose adapter is not running yet needs one of the
    ``max_loras`` slots: without one free, admissions stop there (FCFS, so it is never
    overtaken and never starves: the running adapters drain).
    """
    if not waiting:
        return
    cfg = config
    bs, groups = cfg.block_size, cfg.num_kv_groups
    keeping = max(1, cfg.group_slides.count(False))  # groups whose tables only grow
    num_running = len(running) - num_leaving
    speculative = False
    admits = plan.admits
    hold_back = cfg.enable_prefix_caching and cfg.hold_back_shared_prefixes
    computing = uncommitted_prompt_blocks(running, cfg.block_size) if hold_back else set()
    adapters = running_adapters(running) if cfg.max_loras else set()
    skip = 0  # the other beams of a search just admitted
    for i, seq in enumerate(waiting):
        if skip:
            skip -= 1
            continue
        if budget <= 0 or num_running + len(admits) >= cfg.max_num_seqs:
            break
        if seq.lora_id and seq.lora_id not in adapters:
            if len(adapters) >= cfg.max_loras:
                break  # FCFS: its adapter gets the next slot that frees, nothing overtakes it
            adapters.add(seq.lora_id)
        if seq.params.use_beam_search:
            group = _beam_group(waiting, i)
            used = _admit_group(plan, group, num_running, cfg, free, budget)
            if used is None:
                break  # FCFS: nothing after it
            free, budget, skip = free - used[0], budget - used[1], len(group) - 1
            continue
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
        upper = blocks_for_tokens(first, bs) * groups  # blocks if nothing is cached
        others = num_running + len(admits)
        reserve = cfg.watermark_blocks + others * keeping if others else 0
        if upper + reserve > free:
            # A prefix hit may still make it fit: send it, but nothing after it (FCFS).
            if not cfg.enable_prefix_caching or speculative:
                break
            speculative = True
        priority = min(seq.params.kv_retention_priority, cfg.max_retention_priority)
        pin = seq.params.kv_pin_ttl_s
        admits.append((seq, Admit(seq.seq_id, total, k_max, hashes, reserve, priority, pin)))
        computing.update(hashes)
        free -= min(upper, free)
        budget -= first
        if speculative:
            break


def _beam_group(waiting: list[Sequence], start: int) -> list[Sequence]:
    """The waiting beams of ``waiting[start]``'s request, from ``start`` (they sort together)."""
    end = start
    while end < len(waiting) and waiting[end].req_id == waiting[start].req_id:
        end += 1
    return waiting[start:end]


def _admit_group(
    plan: SchedulePlan,
    group: list[Sequence],
    num_running: int,
    cfg: SchedulerConfig,
    free: int,
    budget: int,
) -> tuple[int, int] | None:
    """Admit a beam search's waiting beams together, or none of them: one admitted alone
    would wait, holding its seat and blocks, for siblings that may never get theirs (the
    engine preempts a search whose beams end up split). The step's tokens are shared
    between them; their blocks are counted as if nothing were cached. Returns the blocks
    and tokens used, or None."""
    bs, k, groups = cfg.block_size, len(group), cfg.num_kv_groups
    keeping = max(1, cfg.group_slides.count(False))
    others = num_running + len(plan.admits)
    if others + k > cfg.max_num_seqs:
        return None
    share = max(1, budget // k) if cfg.enable_chunked_prefill else 0
    firsts = [min(s.num_tokens, share) if share else s.num_tokens for s in group]
    uppers = sum(blocks_for_tokens(f, bs) for f in firsts) * groups
    reserve = cfg.watermark_blocks + (others + k - 1) * keeping if others + k > 1 else 0
    if sum(firsts) > budget or uppers + reserve > free:
        return None
    for j, seq in enumerate(group):
        lookup = cfg.enable_prefix_caching and seq.params.prompt_logprobs is None
        hashes = tuple(seq.full_block_hashes(bs)[: seq.num_tokens // bs]) if lookup else ()
        res = cfg.watermark_blocks + (others + j) * keeping if others + j else 0
        admit = Admit(
            seq.seq_id,
            seq.num_tokens,
            share or seq.num_tokens,
            hashes,
            res,
            min(seq.params.kv_retention_priority, cfg.max_retention_priority),
            seq.params.kv_pin_ttl_s,
        )
        plan.admits.append((seq, admit))
    return uppers, sum(firsts)


def running_adapters(running: list[Sequence]) -> set[int]:
    """The LoRA adapters of ``running`` sequences: each holds a device slot."""
    return {seq.lora_id for seq in running if seq.lora_id}


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
