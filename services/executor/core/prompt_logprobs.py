"""Prompt log-probabilities (``SamplingParams.prompt_logprobs``): read off the logits rows of
every prompt token that a chunk asking for them computed."""

from __future__ import annotations

import torch
from torch import Tensor

from services.executor.core.outputs import TokenLogprob
from services.executor.core.plan import ScheduledBatch
from services.executor.core.sequence import Sequence as Seq

__all__ = ["take_prompt_logprobs"]


def take_prompt_logprobs(batch: ScheduledBatch, logits: Tensor) -> Tensor:
    """Record the prompt log-probabilities the batch's prompt-logprob chunks computed
    (their every token's logits row: position p's row gives token p + 1's), and return
    the rows the sampler reads, one per chunk that samples. Runs before
    ``after_forward``: a chunk starts at its sequence's ``num_computed_tokens``."""
    every = [c.seq.num_computed_tokens < c.seq.prompt_len and c.seq.wants_prompt_logprobs()
             for c in batch.chunks]  # fmt: skip
    if not any(every):  # (the same rule as the batch's chunks were built with)
        return logits
    keep: list[int] = []
    rows: list[int] = []
    targets: list[tuple[Seq, int]] = []  # (sequence, token whose logprob the row gives)
    row = 0
    for (seq, k, need_logits), all_rows in zip(batch.chunks, every, strict=True):
        start = seq.num_computed_tokens
        if seq.num_scheduled_drafts:  # every row, for verification (core.spec.verify)
            keep.extend(range(row, row + k))
            row += k
            continue
        if not all_rows:
            keep.extend([row] if need_logits else [])
            row += need_logits
            continue
        done = len(seq.prompt_logprobs)  # a recomputation skips what it already has
        for p in range(max(start, done), min(start + k, seq.prompt_len - 1)):
            rows.append(row + p - start)
            targets.append((seq, seq.token_ids[p + 1]))
        keep.extend([row + k - 1] if need_logits else [])
        row += k
    if rows:
        lp = torch.log_softmax(logits[torch.tensor(rows, device=logits.device)], dim=-1)
        ids = torch.tensor([t for _, t in targets], device=lp.device)
        chosen = lp.gather(1, ids[:, None]).squeeze(1).tolist()
        top_k = max(seq.params.prompt_logprobs or 0 for seq, _ in targets)
        top_vals, top_ids = lp.topk(top_k, dim=-1) if top_k else (lp[:, :0], lp[:, :0])
        tv, ti = top_vals.tolist(), top_ids.tolist()
        for i, (seq, token) in enumerate(targets):
            n = seq.params.prompt_logprobs or 0
            top = tuple(zip(ti[i][:n], tv[i][:n], strict=True))
            seq.prompt_logprobs.append(TokenLogprob(token, chosen[i], top))
    return logits[torch.tensor(keep, device=logits.device, dtype=torch.long)]
