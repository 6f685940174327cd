"""What the engine holds for speculative decoding (:class:`Speculation`): it verifies the
drafts a forward computed, keeps the accepted ones until their outputs are emitted, and
proposes the next drafts after sampling."""

from __future__ import annotations

from collections.abc import Sequence as Seq

from torch import Tensor

from services.executor.core.plan import ScheduledChunk
from services.executor.core.sequence import SeqStatus, Sequence
from services.executor.core.spec.config import SpeculativeConfig, speculable
from services.executor.core.spec.verify import SpecStats, accept_drafts, propose, verify_greedy

__all__ = ["Speculation"]


class Speculation:
    """One engine's speculative decoding: ``stats`` are vLLM's counters."""

    def __init__(
        self, config: SpeculativeConfig, eos_token_ids: frozenset[int], max_model_len: int
    ) -> None:
        self.config = config
        self.stats = SpecStats(config.num_speculative_tokens)
        self._eos = eos_token_ids
        self._max_model_len = max_model_len
        self._accepted: dict[int, list[int]] = {}  # this step's accepted drafts, by seq_id

    def verify(self, chunks: Seq[ScheduledChunk], logits: Tensor) -> Tensor:
        """The forward's logits (every row of a chunk with drafts) -> a row per sampled
        chunk; the drafts accepted are remembered for :meth:`accept` and :meth:`emitted`."""
        logits, self._accepted = verify_greedy(chunks, logits, self.stats)
        return logits

    def accept(self, sampled: Seq[Sequence]) -> None:
        """After the scheduler advanced the chunks: the accepted drafts join their sequences
        (before the token sampled after them)."""
        if self._accepted:
            by_id = {s.seq_id: s for s in sampled}
            for seq_id, accepted in self._accepted.items():
                accept_drafts(by_id[seq_id], accepted)

    def emitted(self, seq: Sequence, token: int) -> list[int]:
        """The tokens ``seq`` emits in this step: its accepted drafts, then ``token``."""
        accepted = self._accepted.get(seq.seq_id) if self._accepted else None
        return [*accepted, token] if accepted else [token]

    def propose(self, sampled: Seq[Sequence], num_running: int) -> None:
        """Drafts for the next step of each running sample that can be verified greedily
        (none in a batch of ``disable_by_batch_size`` sequences or more); ends the step."""
        self._accepted = {}
        cap = self.config.disable_by_batch_size
        off = bool(cap) and num_running >= cap
        running = SeqStatus.RUNNING
        for seq in sampled:
            if off or seq.status is not running or not speculable(seq.params):
                seq.draft_token_ids = []
                continue
            p = seq.params
            stops = frozenset(p.stop_token_ids) | (frozenset() if p.ignore_eos else self._eos)
            seq.draft_token_ids = propose(seq, self.config, stops, self._max_model_len)
