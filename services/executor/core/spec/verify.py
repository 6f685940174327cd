"""Greedy verification of drafts (speculative decoding): a sequence's chunk computed its last
token and its d drafts, so the forward gave d + 1 logits rows; a draft is accepted while it
equals the argmax of the row before it, and the row after the last accepted one is sampled
as usual (the correction, or the bonus token when every draft was accepted)."""

from __future__ import annotations

from collections.abc import Sequence as Seq

import numpy as np
import torch
from torch import Tensor

from services.executor.core.plan import ScheduledChunk
from services.executor.core.sequence import Sequence
from services.executor.core.spec.config import SpeculativeConfig
from services.executor.core.spec.ngram import propose_ngram

__all__ = ["SpecStats", "accept_drafts", "propose", "verify_greedy"]


class SpecStats:
    """vLLM's counters: drafts (sequence-steps that verified drafts), draft tokens, accepted
    tokens, and accepted tokens by draft position."""

    def __init__(self, num_speculative_tokens: int) -> None:
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * num_speculative_tokens

    def record(self, num_drafted: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        for pos in range(num_accepted):
            self.accepted_per_pos[pos] += 1

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per verifying step of a sequence: 1 + accepted drafts on average."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0


def verify_greedy(
    chunks: Seq[ScheduledChunk], logits: Tensor, stats: SpecStats
) -> tuple[Tensor, dict[int, list[int]]]:
    """``logits``: a row per sampled chunk, but every row of a chunk with drafts (d + 1 of
    them). Returns a row per sampled chunk (for a chunk with drafts, the row after its last
    accepted draft) and each such sequence's accepted drafts, by seq_id."""
    spans: list[tuple[Sequence, int, int]] = []  # (sequence, first row, drafts)
    keep: list[int] = []
    row = 0
    for seq, k, need_logits in chunks:
        drafts = seq.num_scheduled_drafts
        if drafts:
            spans.append((seq, row, drafts))
            keep.append(row)  # (replaced below by the row after the accepted drafts)
            row += k
        elif need_logits:
            keep.append(row)
            row += 1
    if not spans:
        return logits, {}
    rows = torch.tensor(
        [r for _, first, d in spans for r in range(first, first + d)], device=logits.device
    )
    target = logits[rows].argmax(dim=-1).cpu().numpy()
    proposed = np.fromiter(
        (t for seq, _, d in spans for t in seq.draft_token_ids[:d]), dtype=np.int64
    )
    matches = target == proposed
    accepted: dict[int, list[int]] = {}
    at, i = 0, 0
    for index, pos in enumerate(keep):
        if i < len(spans) and spans[i][1] == pos:
            seq, first, d = spans[i]
            run = matches[at : at + d]
            a = int(run.argmin()) if not run.all() else d
            accepted[seq.seq_id] = seq.draft_token_ids[:a]
            keep[index] = first + a
            stats.record(d, a)
            at += d
            i += 1
    return logits[torch.tensor(keep, device=logits.device)], accepted


def accept_drafts(seq: Sequence, accepted: list[int]) -> None:
    """After the forward that verified ``seq``'s drafts: ``accepted`` (its first drafts)
    join its tokens, their KV computed. The pool counts them with the sequence's next grow
    (``num_unreported``), and their blocks commit after that step's forward (a commit goes
    out before the grow in a Step, when the pool does not count them yet)."""
    seq.token_ids.extend(accepted)
    seq.num_computed_tokens += len(accepted)
    seq.num_unreported += len(accepted)
    seq.num_scheduled_drafts = 0
    seq.draft_token_ids = []


def propose(
    seq: Sequence, config: SpeculativeConfig, stop_token_ids: frozenset[int], max_model_len: int
) -> list[int]:
    """``seq``'s drafts for its next step: no more than it may still emit after its next
    token (``max_tokens``, ``max_model_len``), none past a stop token."""
    params = seq.params
    room = min(params.max_tokens - seq.num_output_tokens, max_model_len - len(seq.token_ids)) - 1
    if room <= 0:
        return []
    return propose_ngram(
        seq.token_ids,
        min(config.num_speculative_tokens, room),
        min_n=config.prompt_lookup_min,
        max_n=config.prompt_lookup_max,
        stop_token_ids=stop_token_ids,
    )
