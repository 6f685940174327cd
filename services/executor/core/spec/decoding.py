"""What the engine holds for speculative decoding (:class:`Speculation`): it verifies the
drafts a forward computed (:mod:`.verify`), hands the engine each drafting sequence's tokens
to emit, and proposes the next drafts after sampling."""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as Seq
from typing import Any

from torch import Tensor

from services.executor.core.config import EngineSettings
from services.executor.core.grammar import GrammarCompiler
from services.executor.core.outputs import SeqOutput, TokenLogprob
from services.executor.core.plan import ScheduledChunk
from services.executor.core.runner import Runner
from services.executor.core.sampler import Sampler, SampleResult, SeededGenerators
from services.executor.core.sequence import SeqStatus, Sequence
from services.executor.core.spec.config import SpeculativeConfig, speculable
from services.executor.core.spec.draft import DraftProposer
from services.executor.core.spec.eagle import EagleProposer, HeadRunner
from services.executor.core.spec.verify import (
    Verified,
    accept_drafts,
    draft_room,
    grammar_drafts,
    propose,
    verify,
)

__all__ = ["SpecStats", "Speculation"]


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


class Speculation:
    """One engine's speculative decoding: ``stats`` are vLLM's counters."""

    def __init__(
        self,
        settings: EngineSettings,
        sampler: Sampler,
        generators: SeededGenerators,
        grammars: GrammarCompiler | None,
        draft: Runner | None = None,
        head: HeadRunner | None = None,
        features: Callable[[], Tensor | None] | None = None,
    ) -> None:
        """The engine's ``settings`` (their ``speculative_config`` set), and the sampler,
        seeded generators and grammar compiler its rows are sampled and masked with; the
        ``draft`` model's runner, for the ``draft_model`` method; the EAGLE ``head``'s runner
        and the target's last ``features``, for ``eagle3``."""
        assert settings.speculative_config is not None
        self.config: SpeculativeConfig = settings.speculative_config
        self.drafter: DraftProposer | None = None
        self.eagle: EagleProposer | None = None
        # A draft model or head reads a full-attention group's tables (start-up refuses a
        # pool without one).
        group = settings.scheduler.group_slides.index(False) if self.config.has_draft_cache else 0
        if self.config.uses_draft_model:
            if draft is None:
                raise ValueError("speculative_config.model: the runner has no draft model")
            budget = settings.scheduler.max_num_batched_tokens
            self.drafter = DraftProposer(draft, settings.vocab_size, budget, group, grammars)
        if self.config.uses_eagle:
            if head is None or features is None:
                raise ValueError("speculative_config.model: the runner has no EAGLE-3 head")
            self.eagle = EagleProposer(head, features, settings.vocab_size, group, grammars)
        self.stats = SpecStats(self.config.num_speculative_tokens)
        self._eos_ids = settings.eos_token_ids
        self._eos = frozenset(settings.eos_token_ids)
        self._max_model_len = settings.max_model_len
        self._sampler, self._generators, self._grammars = sampler, generators, grammars
        self.verified: list[Verified] = []  # this step's, until :meth:`propose` ends it
        self._by_seq: dict[int, Verified] = {}

    @classmethod
    def of(
        cls,
        settings: EngineSettings,
        sampler: Sampler,
        generators: SeededGenerators,
        grammars: GrammarCompiler | None,
        runner: Runner,
    ) -> Speculation | None:
        """The engine's speculative decoding, if its ``settings`` ask for it; a draft model
        runs on ``runner.draft`` (ModelRunner's)."""
        if settings.speculative_config is None:
            return None
        head = getattr(runner, "eagle", None)
        features = (lambda: runner.aux_hidden) if head is not None else None  # type: ignore[attr-defined]
        draft = getattr(runner, "draft", None)
        return cls(settings, sampler, generators, grammars, draft, head, features)

    def scheduler_settings(self) -> dict[str, Any]:
        """What the scheduler's config takes of speculation (SchedulerConfig's fields)."""
        cfg = self.config
        return {
            "speculative": True,
            "num_speculative_tokens": cfg.num_speculative_tokens,
            "spec_disable_by_batch_size": cfg.disable_by_batch_size,
        }

    def verify(self, chunks: Seq[ScheduledChunk], logits: Tensor) -> Tensor:
        """Verify the drafts the forward computed; returns the logits rows of the other
        sampled chunks (one each). Each drafting sequence's tokens wait in ``verified``."""
        if self.eagle is not None:
            self.eagle.computed(chunks)
        logits, self.verified = verify(
            chunks, logits, self._sampler, self._generators, self._eos_ids, self._grammars
        )
        self._by_seq = {v.seq.seq_id: v for v in self.verified}
        for v in self.verified:
            self.stats.record(v.seq.num_scheduled_drafts, v.num_accepted)
            if self.drafter is not None:
                self.drafter.verified(v.seq, v.num_accepted)
        return logits

    def draft(self, chunks: Seq[ScheduledChunk]) -> None:
        """Before the forward of ``chunks``: a draft model makes their drafts (the n-gram
        proposer made them after the last step)."""
        if self.drafter is not None:
            self.drafter.draft(chunks)
        if self.eagle is not None:
            self.eagle.draft(chunks)

    def accept(self) -> None:
        """After the scheduler advanced the chunks: the accepted drafts join their sequences
        (the token sampled after them is the engine's to append, as any sampled token)."""
        for v in self.verified:
            accept_drafts(v.seq, v.tokens[:-1])

    def unsampled(self, seqs: list[Sequence]) -> list[Sequence]:
        """``seqs`` without the ones verified (sampled) in this step."""
        return [s for s in seqs if s.seq_id not in self._by_seq]

    def join(self, targets: list[tuple[Sequence, int]], result: SampleResult) -> None:
        """Add the verified sequences to the sampler's ``result`` for ``targets``: each with
        the token sampled after its accepted drafts."""
        for v in self.verified:
            targets.append((v.seq, 0))
            result.token_ids.append(v.tokens[-1])
            result.logprobs.append(v.logprobs[-1])

    def fill(self, out: SeqOutput, seq: Sequence) -> bool:
        """If ``seq`` was verified in this step: ``out`` carries its accepted drafts before its
        sampled token, with their log-probabilities where asked; returns whether it was."""
        v = self._by_seq.get(seq.seq_id)
        if v is None:
            return False
        out.token_ids = list(v.tokens)
        if v.logprobs[0] is not None:
            out.logprobs = tuple(
                TokenLogprob(t, lp[0], tuple(lp[1]))
                for t, lp in zip(v.tokens, v.logprobs, strict=True)
                if lp is not None
            )
        return True

    def propose(self, sampled: Seq[Sequence], num_running: int) -> None:
        """Drafts for the next step of each running sample that can be speculated (none in a
        batch of ``disable_by_batch_size`` sequences or more); ends the step."""
        cap = self.config.disable_by_batch_size
        off = bool(cap) and num_running >= cap
        running = SeqStatus.RUNNING
        for seq in sampled:
            seq.draft_token_ids = []
            if off or seq.status is not running or not speculable(seq.params):
                seq.num_planned_drafts = 0
            elif self.drafter is not None:  # drafted once scheduled (the draft's cache)
                seq.num_planned_drafts = draft_room(seq, self.config, self._max_model_len)
            elif self.eagle is not None:  # its first draft comes with the catch-up below
                seq.num_planned_drafts, seq.draft_state = 0, None
            else:
                stops = seq.params.ending_token_ids(self._eos)
                drafts = propose(seq, self.config, stops, self._max_model_len)
                if seq.matcher is not None and drafts:
                    drafts = grammar_drafts(seq.matcher, drafts)
                seq.draft_token_ids = drafts
                seq.num_planned_drafts = len(drafts)
        if self.eagle is not None:
            # Off for the step: nothing drafts, and the head does not catch up either (its KV
            # of these rows is left stale: fewer drafts accepted later, no output changes).
            drafting = {s.seq_id for s in sampled if s.status is running and speculable(s.params)}
            room = self._max_model_len
            self.eagle.catch_up(
                lambda s, k: 1 + v.num_accepted if (v := self._by_seq.get(s.seq_id)) else k,
                lambda s: draft_room(s, self.config, room) if s.seq_id in drafting else 0,
                skip=off,
            )
        self.verified, self._by_seq = [], {}
