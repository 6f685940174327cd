"""The EAGLE-3 proposer: a draft head that reads the target's features
(``services.executor.model.eagle``) drafts each speculating sequence's tokens.

The head's KV at position ``i`` is computed from the target's features of ``i`` and token
``i + 1``; it lives in its own one-layer cache over the target's blocks, as a draft model's
does. Two halves per step:

- **After sampling** (:meth:`EagleProposer.catch_up`): every row the target computed in the
  step, and kept (a verified sequence's last token and accepted drafts; a prompt chunk's
  tokens), goes through the head with its features and the token after it, known now. This
  fills the head's cache where the target's was written, and the last row of each sequence
  that will draft gives its first draft and the head's pre-norm output there.
- **Once the next step is scheduled** (:meth:`EagleProposer.draft`), before its forward:
  drafts 2 .. k, one forward each, feed the head's own last output back in place of the
  target's features, at the positions the target verifies them at (the step's slots). Their
  KV is written again from the target's features by the next catch-up.

Where the head's cache is stale (a block filled from a tier, a prefix hit's blocks written
when another token followed), fewer drafts are accepted, and no output changes. Prefix hits
stop one block short (the pool's ``prefix_hit_margin``), so a hit's last block, whose last
position's KV depends on the token after it, is computed again.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as Seq
from typing import NamedTuple, Protocol

import torch
from torch import Tensor

from services.executor.core.grammar import GrammarCompiler
from services.executor.core.plan import ScheduledChunk
from services.executor.core.sequence import Sequence
from services.executor.core.spec.draft import grammar_argmax, walkers_of
from services.executor.model.forward_batch import SeqChunk

__all__ = ["EagleProposer", "HeadRunner", "StepRow"]


class HeadRunner(Protocol):
    """A draft head's runner (``Eagle3Runner``): one forward of ``chunks``, ``hidden`` a row
    per token; returns (logits, pre-norm output) of the rows that want logits."""

    def execute(self, chunks: Seq[SeqChunk], hidden: Tensor) -> tuple[Tensor, Tensor]: ...


class StepRow(NamedTuple):
    """A chunk the target computed: its sequence, first position, tokens, and first row of
    the step's features."""

    seq: Sequence
    start: int
    num_tokens: int
    row: int


class EagleProposer:
    """Drafts with ``runner`` (the head's) from the target's ``features()`` (the last forward's
    ``[T, 3 H]``), for a target of ``vocab_size`` tokens, reading the block tables of
    KV-cache group ``group`` (a full-attention one); within a sample's grammar, if any."""

    def __init__(
        self,
        runner: HeadRunner,
        features: Callable[[], Tensor | None],
        vocab_size: int,
        group: int = 0,
        grammars: GrammarCompiler | None = None,
    ) -> None:
        self.runner, self.features = runner, features
        self.vocab_size, self.group, self.grammars = vocab_size, group, grammars
        self._rows: list[StepRow] = []
        self._features: Tensor | None = None

    def computed(self, chunks: Seq[ScheduledChunk]) -> None:
        """The target computed ``chunks`` (before the scheduler advances them): keep their
        rows and the forward's features for :meth:`catch_up`."""
        rows, row = [], 0
        for seq, k, _ in chunks:
            rows.append(StepRow(seq, seq.num_computed_tokens, k, row))
            row += k
        self._rows, self._features = rows, self.features()

    def catch_up(
        self,
        kept: Callable[[Sequence, int], int],
        drafts: Callable[[Sequence], int],
        skip: bool = False,
    ) -> None:
        """After sampling: the head computes the step's rows that were kept (``kept(seq, k)``
        of a chunk of ``k``), and each sequence with ``drafts(seq) > 0`` gets its first
        draft and the head's state to draft on from; nothing if ``skip`` (speculation off for
        the step: those rows' head KV stays stale)."""
        rows, features = self._rows, self._features
        self._rows, self._features = [], None
        if skip or not rows or features is None:
            return
        g = self.group
        chunks: list[SeqChunk] = []
        index: list[int] = []
        wanting: list[Sequence] = []
        for seq, start, k, row in rows:
            used = kept(seq, k)
            n = min(used, len(seq.token_ids) - start - 1)
            table = seq.tables[g] if len(seq.tables) > g else []
            if n <= 0 or seq.params.use_beam_search or not table:
                continue  # (beams: their blocks are shared, and they never draft)
            want = n == used and drafts(seq) > 0
            chunks.append(SeqChunk(seq.token_ids[start + 1 : start + 1 + n], start, table, want))
            index.extend(range(row, row + n))
            if want:
                wanting.append(seq)
        if not chunks:
            return
        rows_of = torch.tensor(index, dtype=torch.int64, device=features.device)
        logits, state = self.runner.execute(chunks, features.index_select(0, rows_of))
        if not wanting:
            return
        tokens = grammar_argmax(
            logits, wanting, walkers_of(wanting), self.vocab_size, self.grammars
        )
        for i, (seq, token) in enumerate(zip(wanting, tokens, strict=True)):
            seq.draft_token_ids, seq.draft_state = [token], state[i]
            seq.num_planned_drafts = drafts(seq)

    def draft(self, chunks: Seq[ScheduledChunk]) -> None:
        """Before the forward of ``chunks``: drafts 2 .. k of each sequence with more than one
        scheduled, from the first draft and the head's state its catch-up left."""
        drafting = [
            s for s, _, _ in chunks if s.num_scheduled_drafts > 1 and s.draft_state is not None
        ]
        walkers = walkers_of(drafting)
        for seq in drafting:  # past the first draft
            walker = walkers.get(seq.seq_id)
            if walker is not None and (not walker.accept(seq.draft_token_ids[0]) or walker.done):
                del walkers[seq.seq_id]
        g, j = self.group, 1
        while drafting:
            step = [
                SeqChunk([s.draft_token_ids[-1]], s.num_computed_tokens + j - 1, s.tables[g])
                for s in drafting
            ]
            state = torch.stack([s.draft_state for s in drafting])
            logits, state = self.runner.execute(step, state)
            tokens = grammar_argmax(logits, drafting, walkers, self.vocab_size, self.grammars)
            for i, (seq, token) in enumerate(zip(drafting, tokens, strict=True)):
                seq.draft_token_ids.append(token)
                seq.draft_state = state[i]
            j += 1
            drafting = [s for s in drafting if s.num_scheduled_drafts > j]
        for seq, _, _ in chunks:
            seq.draft_state = None  # spent: the next catch-up makes a new one
