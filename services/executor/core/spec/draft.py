"""The draft-model proposer: once a step is scheduled, and before its forward, a smaller model
of the same vocabulary drafts each speculating sequence's tokens, k of them in k forwards.

The draft model has its own KV cache over the target's blocks (model.draft), so it computes
what the target computes in the same slots:
- every prompt chunk of the step, so that a prompt's draft KV is in its blocks as the target's
  is (prefix hits read both);
- for a drafting sequence, first the verified tokens it has not seen (``num_draft_computed``
  up to the sequence's last token), whose last logits give draft 1; then drafts 1 .. k-1, one
  forward each, give drafts 2 .. k.

Draft j is written at the position the target verifies it at. When it is accepted its KV is
the one the draft model would compute for that token, so only the last draft, never fed, is
left to compute with the next step's drafts. Drafts are the draft model's argmax: a draft is
one token with certainty, which is what verification assumes (core.spec.verify).

Decodes that draft nothing in a step (speculation off for a large batch) are left for the
draft model to catch up on when they next draft. Its KV shapes proposals only: where it is
stale (a block filled from a tier), fewer drafts are accepted, and no output changes.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

from services.executor.core.plan import ScheduledChunk
from services.executor.core.runner import Runner
from services.executor.core.sequence import Sequence
from services.executor.model.forward_batch import SeqChunk

__all__ = ["DraftProposer"]


class DraftProposer:
    """Drafts with ``runner`` (the draft model's), for a target of ``vocab_size`` tokens (a
    draft's padded vocabulary may be larger: its extra ids are never drafted), reading the
    block tables of KV-cache group ``group`` (a full-attention one)."""

    def __init__(self, runner: Runner, vocab_size: int, group: int = 0) -> None:
        self.runner = runner
        self.vocab_size = vocab_size
        self.group = group

    def draft(self, chunks: Seq[ScheduledChunk]) -> None:
        """Fill ``draft_token_ids`` of each chunk's sequence that has drafts scheduled, and
        compute the prompt chunks' KV in the draft model's cache."""
        first: list[SeqChunk] = []
        drafting: list[Sequence] = []
        g = self.group
        for seq, k, _ in chunks:
            drafts = seq.num_scheduled_drafts
            start = seq.num_computed_tokens
            done = seq.num_draft_computed
            begin = start if done is None else min(done, start)
            if not drafts and k == 1:  # a decode drafting nothing: caught up on later
                seq.num_draft_computed = begin
                continue
            end = start + k - drafts  # its known tokens computed in this step
            first.append(SeqChunk(seq.token_ids[begin:end], begin, seq.tables[g], bool(drafts)))
            seq.num_draft_computed = end
            if drafts:
                drafting.append(seq)
        if not first:
            return
        logits = self.runner.execute(first)
        if not drafting:
            return
        tokens = logits[:, : self.vocab_size].argmax(dim=-1).tolist()
        for seq, token in zip(drafting, tokens, strict=True):
            seq.draft_token_ids = [token]
        for j in range(1, max(s.num_scheduled_drafts for s in drafting)):
            drafting = [s for s in drafting if s.num_scheduled_drafts > j]
            step = [
                SeqChunk([s.draft_token_ids[-1]], s.num_computed_tokens + j, s.tables[g])
                for s in drafting
            ]
            logits = self.runner.execute(step)
            tokens = logits[:, : self.vocab_size].argmax(dim=-1).tolist()
            for seq, token in zip(drafting, tokens, strict=True):
                seq.draft_token_ids.append(token)

    @staticmethod
    def verified(seq: Sequence, num_accepted: int) -> None:
        """``seq``'s drafts were verified (before the scheduler advances it): the draft model
        fed the accepted ones but the last draft (see the module docstring)."""
        fed = seq.num_scheduled_drafts - 1
        seq.num_draft_computed = seq.num_computed_tokens + 1 + min(num_accepted, fed)
