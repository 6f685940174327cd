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
left to compute with the next step's drafts. Drafts are the draft model's argmax (within
the sample's grammar, if it has one): a draft is one token with certainty, which is what
verification assumes (core.spec.verify).

Decodes that draft nothing are computed with the others when the draft model runs, and left
for later in a step where it does not (no prompt chunk, nothing drafting: speculation off for
a large batch); what it has not seen is computed in forwards of at most the step's token
budget. Its KV shapes proposals only: where it is stale (a block filled from a tier, or
committed by a sequence it lagged behind), fewer drafts are accepted, and no output changes.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

from torch import Tensor

from services.executor.core.grammar import GrammarCompiler, Matcher
from services.executor.core.plan import ScheduledChunk
from services.executor.core.runner import Runner
from services.executor.core.sequence import Sequence
from services.executor.model.forward_batch import SeqChunk

__all__ = ["DraftProposer", "grammar_argmax", "walkers_of"]


class DraftProposer:
    """Drafts with ``runner`` (the draft model's), for a target of ``vocab_size`` tokens (a
    draft's padded vocabulary may be larger: its extra ids are never drafted), in forwards of
    at most ``max_num_tokens``, reading the block tables of KV-cache group ``group`` (a
    full-attention one). A sample under a grammar drafts within it (``grammars`` masks its
    rows, as its verification will)."""

    def __init__(
        self,
        runner: Runner,
        vocab_size: int,
        max_num_tokens: int,
        group: int = 0,
        grammars: GrammarCompiler | None = None,
    ) -> None:
        self.runner = runner
        self.vocab_size = vocab_size
        self.max_num_tokens = max_num_tokens  # per forward: the step's token budget
        self.group = group
        self.grammars = grammars

    def draft(self, chunks: Seq[ScheduledChunk]) -> None:
        """Fill ``draft_token_ids`` of each chunk's sequence that has drafts scheduled; the
        draft model computes the prompt chunks too, and the decodes' tokens when it runs."""
        pending: list[tuple[Sequence, int, int]] = []  # (sequence, first, end) to compute
        drafting: list[Sequence] = []
        prompts = False
        g = self.group
        for seq, k, _ in chunks:
            drafts = seq.num_scheduled_drafts
            start = seq.num_computed_tokens
            done = seq.num_draft_computed
            begin = start if done is None else min(done, start)
            end = start + k - drafts  # its known tokens computed in this step
            pending.append((seq, begin, end))
            seq.num_draft_computed = begin
            if drafts:
                drafting.append(seq)
            prompts = prompts or k > 1 + drafts
        if not drafting and not prompts:
            return  # decodes only, none drafting: caught up on when they next draft
        # A drafting sample's grammar, past its drafts so far.
        walkers = walkers_of(drafting)
        # What it has not seen, in forwards of at most the step's token budget (a sequence's
        # pieces in order); each drafting sequence's last piece gives its first draft.
        while pending:
            room, step, later, firsts = self.max_num_tokens, [], [], []
            for seq, begin, end in pending:
                stop = min(end, begin + max(room, 0))
                if stop == begin:
                    later.append((seq, begin, end))
                    continue
                last = stop == end and bool(seq.num_scheduled_drafts)
                step.append(SeqChunk(seq.token_ids[begin:stop], begin, seq.tables[g], last))
                seq.num_draft_computed = stop
                room -= stop - begin
                if stop < end:
                    later.append((seq, stop, end))
                elif last:
                    firsts.append(seq)
            tokens = grammar_argmax(
                self.runner.execute(step), firsts, walkers, self.vocab_size, self.grammars
            )
            for seq, token in zip(firsts, tokens, strict=True):
                seq.draft_token_ids = [token]
            pending = later
        for j in range(1, max((s.num_scheduled_drafts for s in drafting), default=0)):
            drafting = [s for s in drafting if s.num_scheduled_drafts > j]
            step = [
                SeqChunk([s.draft_token_ids[-1]], s.num_computed_tokens + j, s.tables[g])
                for s in drafting
            ]
            tokens = grammar_argmax(
                self.runner.execute(step), drafting, walkers, self.vocab_size, self.grammars
            )
            for seq, token in zip(drafting, tokens, strict=True):
                seq.draft_token_ids.append(token)

    @staticmethod
    def verified(seq: Sequence, num_accepted: int) -> None:
        """``seq``'s drafts were verified (before the scheduler advances it): the draft model
        fed the accepted ones but the last draft (see the module docstring)."""
        fed = seq.num_scheduled_drafts - 1
        seq.num_draft_computed = seq.num_computed_tokens + 1 + min(num_accepted, fed)


def walkers_of(seqs: Seq[Sequence]) -> dict[int, Matcher]:
    """A copy of each of ``seqs``' grammar matcher (those that have one), to draft within."""
    return {s.seq_id: s.matcher.copy() for s in seqs if s.matcher is not None}


def grammar_argmax(
    logits: Tensor,
    seqs: Seq[Sequence],
    walkers: dict[int, Matcher],
    vocab_size: int,
    grammars: GrammarCompiler | None,
) -> list[int]:
    """The draft of each of ``seqs`` (a logits row each, over at least the target's
    ``vocab_size`` ids): its argmax, within its grammar while it has one (``walkers``,
    advanced past the draft; a grammar that refused or ended stops masking: verification
    takes none of the drafts from there)."""
    logits = logits[:, :vocab_size]
    rows = {i: walkers[s.seq_id] for i, s in enumerate(seqs) if s.seq_id in walkers}
    if rows and grammars is not None:
        logits = logits.contiguous()
        grammars.mask_logits(logits, rows)
    tokens: list[int] = logits.argmax(dim=-1).tolist()
    for i, walker in rows.items():
        if not walker.accept(tokens[i]) or walker.done:
            del walkers[seqs[i].seq_id]
    return tokens
