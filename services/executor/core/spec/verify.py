"""Verification of drafts (speculative decoding). A sequence's chunk computed its last token
and its d drafts, so the forward gave d + 1 logits rows: row j is the distribution of the token
after draft j (row 0: after its last token). Each row is sampled as the sequence's next token
would be with the drafts before it taken as its output (penalties, bias, min_tokens, its
seed's draw for that output position, log-probabilities); drafts are accepted while each equals
the token sampled before it, and the first token that differs (or the one after the last
draft) ends the step.

A draft of the n-gram proposer, or of a draft model (its argmax), is one token with certainty
(q is one-hot), so this *is*
speculative sampling's rejection rule: the draft d is accepted with probability
min(1, p(d) / q(d)) = p(d), and a rejection draws from norm(max(p - q, 0)), which is p without
d. The outputs are distributed as without speculation; greedy and seeded samples give exactly
the same tokens (a seed draws per output position). An accepted draft that is a stop token
ends the sequence there."""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch
from torch import Tensor

from services.common.sampling_params import SamplingParams
from services.executor.core.grammar import GrammarCompiler, Matcher, accept
from services.executor.core.plan import ScheduledChunk
from services.executor.core.sampler import RowState, Sampler, SeededGenerators
from services.executor.core.sequence import Sequence
from services.executor.core.spec.config import SpeculativeConfig
from services.executor.core.spec.ngram import propose_ngram

__all__ = ["Verified", "accept_drafts", "draft_room", "grammar_drafts", "propose", "verify"]

Logprob = tuple[float, list[tuple[int, float]]] | None


class Verified:
    """One sequence's verification: ``tokens`` (its accepted drafts, then the token sampled
    after them) and the log-probabilities of each (None where not asked)."""

    __slots__ = ("logprobs", "seq", "tokens")

    def __init__(self, seq: Sequence, tokens: list[int], logprobs: list[Logprob]) -> None:
        self.seq, self.tokens, self.logprobs = seq, tokens, logprobs

    @property
    def num_accepted(self) -> int:
        return len(self.tokens) - 1


def verify(
    chunks: Seq[ScheduledChunk],
    logits: Tensor,
    sampler: Sampler,
    generators: SeededGenerators,
    eos_token_ids: tuple[int, ...],
    grammars: GrammarCompiler | None = None,
) -> tuple[Tensor, list[Verified]]:
    """``logits``: a row per sampled chunk, but every row of a chunk with drafts. Returns the
    rows of the other sampled chunks (one each, in order) and each drafting sequence's
    verification. A sample under a grammar has each row masked to what its grammar allows
    after the drafts before it."""
    spans: list[tuple[Sequence, int, int]] = []  # (sequence, first row, drafts)
    keep: list[int] = []
    row = 0
    for seq, k, need_logits in chunks:
        if seq.num_scheduled_drafts:
            spans.append((seq, row, seq.num_scheduled_drafts))
            row += k
        elif need_logits:
            keep.append(row)
            row += 1
    if not spans:
        return logits, []
    rows: list[int] = []
    params: list[SamplingParams] = []
    states: dict[int, RowState] = {}
    masks: dict[int, Matcher] = {}
    checked: list[tuple[Sequence, int]] = []  # (sequence, the drafts its rows verify)
    for seq, first, drafts in spans:
        generator = generators.get(seq.seq_id)
        if seq.matcher is not None:
            rows_masks, drafts = _draft_row_matchers(
                seq.matcher, seq.draft_token_ids[:drafts], len(rows)
            )
            masks.update(rows_masks)
        checked.append((seq, drafts))
        for j in range(drafts + 1):
            state = _draft_row_state(seq, j, generator, eos_token_ids)
            if state is not None:
                states[len(rows)] = state
            rows.append(first + j)
            params.append(seq.params)
    draft_logits = logits[torch.tensor(rows, device=logits.device)]
    if masks and grammars is not None:
        grammars.mask_logits(draft_logits, masks)
    result = sampler(draft_logits, params, states)
    verified: list[Verified] = []
    at, eos = 0, frozenset(eos_token_ids)
    for seq, drafts in checked:
        sampled = result.token_ids[at : at + drafts + 1]
        stops = seq.params.ending_token_ids(eos)
        accepted = 0
        while accepted < drafts and sampled[accepted] == seq.draft_token_ids[accepted]:
            if sampled[accepted] in stops:
                break  # the sequence ends there: the stop token is its last
            accepted += 1
        verified.append(
            Verified(seq, sampled[: accepted + 1], result.logprobs[at : at + accepted + 1])
        )
        at += drafts + 1
    rest = logits[torch.tensor(keep, device=logits.device, dtype=torch.long)]
    return rest, verified


def _draft_row_matchers(
    matcher: Matcher, drafts: list[int], first_row: int
) -> tuple[dict[int, Matcher], int]:
    """The grammar state of each row of a draft (by row index from ``first_row``): after the
    drafts before it; and how many drafts can be verified: those before the first the grammar
    refuses or ends on (an end is sampled, never drafted: no row is masked by an ended
    grammar, and the sample ends where it would without speculation)."""
    states: dict[int, Matcher] = {}
    walker = matcher.copy()
    for j, token in enumerate(drafts):
        states[first_row + j] = walker.copy()
        if not walker.accept(token) or walker.done:
            return states, j
    states[first_row + len(drafts)] = walker
    return states, len(drafts)


def grammar_drafts(matcher: Matcher, drafts: list[int]) -> list[int]:
    """The leading ``drafts`` the sample's grammar allows and does not end on (a draft it
    refuses would be rejected anyway; an end is sampled, not drafted)."""
    walker = matcher.copy()
    for j, token in enumerate(drafts):
        if not walker.accept(token) or walker.done:
            return drafts[:j]
    return drafts


def _draft_row_state(
    seq: Sequence, j: int, generator: object, eos_token_ids: tuple[int, ...]
) -> RowState | None:
    """The sampler's state of ``seq``'s row after its first ``j`` drafts: they count as its
    output (penalties, min_tokens), and the row draws for output position ``+ j``."""
    state = RowState.of(seq, generator, eos_token_ids)  # type: ignore[arg-type]
    if state is None or not j:
        return state
    p = seq.params
    drafts = seq.draft_token_ids[:j]
    banned = state.banned_token_ids if seq.num_output_tokens + j < p.min_tokens else ()
    return RowState(
        prompt_token_ids=state.prompt_token_ids,
        output_token_ids=[*state.output_token_ids, *drafts] if p.has_penalties else [],
        generator=state.generator,
        banned_token_ids=banned,
        position=state.position + j,
    )


def accept_drafts(seq: Sequence, accepted: list[int]) -> None:
    """After the forward that verified ``seq``'s drafts: ``accepted`` (its first drafts)
    join its tokens, their KV computed. The pool counts them with the sequence's next grow
    (``num_unreported``), and their blocks commit after that step's forward (a commit goes
    out before the grow in a Step, when the pool does not count them yet)."""
    seq.token_ids.extend(accepted)
    if seq.matcher is not None:
        for token in accepted:
            accept(seq.matcher, token)
    seq.num_computed_tokens += len(accepted)
    seq.num_unreported += len(accepted)
    seq.num_scheduled_drafts = 0
    seq.draft_token_ids = []


def draft_room(seq: Sequence, config: SpeculativeConfig, max_model_len: int) -> int:
    """How many drafts ``seq``'s next step may verify: no more than it may still emit after
    its next token (``max_tokens``, ``max_model_len``)."""
    params = seq.params
    room = min(params.max_tokens - seq.num_output_tokens, max_model_len - len(seq.token_ids)) - 1
    return max(0, min(config.num_speculative_tokens, room))


def propose(
    seq: Sequence, config: SpeculativeConfig, stop_token_ids: frozenset[int], max_model_len: int
) -> list[int]:
    """``seq``'s n-gram drafts for its next step: within :func:`draft_room`, none past a stop
    token."""
    room = draft_room(seq, config, max_model_len)
    if room <= 0:
        return []
    return propose_ngram(
        seq.token_ids,
        room,
        min_n=config.prompt_lookup_min,
        max_n=config.prompt_lookup_max,
        stop_token_ids=stop_token_ids,
    )
